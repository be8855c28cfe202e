"""Sharded (FSDP2 with the pack's communication): options, the int8 reduce-scatter's maths, the
default policy's units and the meshes a module may be sharded over, then two launches shared by the
trainer-level tests: 2 CPU processes over Gloo (parity with Lightning's ModelParallelStrategy and DDP,
a module sharded as Lightning's docs show, tied embeddings, compressed reduce-scatters against
uncompressed, stop and resume, torch's warnings) and 4 (HSDP 2x2 against a written-out one-step
reference, resume, resume at another shard count), launched at once.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import SCRIPTS, run_script
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_dist.collectives import Communicator
from lightning_dist.compression import Exchange, make_compressor, simulate
from lightning_dist.compression.int8 import QMAX
from lightning_dist.compression.reduce_scatter import int8_reduce_scatter, int8_reduce_scatter_bytes
from lightning_dist.layout.sharded_mesh import mesh_refusal
from lightning_dist.layout.sharding_policy import plan_units, shard_by_layer
from lightning_dist.testing import run_in_threads
from lightning_dist.wire.sharded_comm import PackAllGather, PackReduceScatter, ReplicaSync

SCRIPT = str(SCRIPTS / "sharded_run.py")
MLP_SIZES = (12, 40, 24, 3)
"""tests/scripts/sharded_run.py's MLP."""
MLP_LR = 0.1
STEPS = 20
"""Steps of the 2-process runs compared with the uncompressed one (AdamW, lr 3e-3, the tiny workload
with two blocks)."""


# -- options (no processes) --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"compression": "int4"}, ["compression='int4'", "'bf16'", "'int8'"]),
        ({"compression": "bf16", "error_feedback": True}, ["error_feedback=True", "compression='int8'"]),
        ({"int8_block_size": 0}, ["int8_block_size=0", ">= 1"]),
        ({"replicas": 0}, ["replicas=0", ">= 1"]),
        ({"replica_sync": "nope"}, ["replica_sync='nope'", "powersgd", "Compressor"]),
        ({"process_group_backend": "tcp"}, ["process_group_backend='tcp'", "'gloo'", "'nccl'"]),
        ({"reduce_op": "max"}, ["reduce_op='max'", "'adasum'"]),
        (
            {"reduce_op": "adasum", "replica_sync": "int8"},
            ["reduce_op='adasum'", "replica_sync='int8'", "'bf16'"],
        ),
        ({"bucket_cap_mb": 25}, ["bucket_cap_mb", "replica_sync", "int8_block_size"]),
    ],
)
def test_bad_options_name_the_argument_and_what_is_accepted(kwargs: dict[str, Any], names: list[str]) -> None:
    from lightning_dist import Sharded

    with pytest.raises(ValueError) as err:
        Sharded(**kwargs)
    for name in names:
        assert name in str(err.value)


def test_replicas_must_divide_the_world_size_before_the_group_forms() -> None:
    from lightning_dist import Sharded

    strategy = Sharded(replicas=2)
    strategy.parallel_devices = [torch.device("cpu")] * 3
    with pytest.raises(ValueError, match=r"replicas=2 must divide the world size 3.*accepted: 1, 3"):
        strategy.setup_environment()


def test_registered_names_build_the_strategy() -> None:
    from lightning_dist import Sharded

    for name, compression in (("ld_sharded", None), ("ld_sharded_bf16", "bf16"), ("ld_sharded_int8", "int8")):
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
        assert isinstance(trainer.strategy, Sharded)
        assert trainer.strategy.options.compression == compression


# -- the int8 reduce-scatter's maths (in process) ---------------------------------------------------
@pytest.mark.parametrize(
    ("world_size", "numel", "block"), [(2, 2 * 300, 64), (3, 3 * 1000, 128), (4, 4 * 5, 1024)]
)
def test_int8_reduce_scatter_is_within_half_a_step_per_rank(world_size: int, numel: int, block: int) -> None:
    """Each rank's chunk of each input is quantised with its block's scale s = absmax / 127, so
    dequantising errs by at most s / 2 per element; the average errs by at most sum_r(s_r / 2) / W."""
    g = torch.Generator().manual_seed(world_size)
    inputs = [torch.randn(numel, generator=g) * (1 + r) for r in range(world_size)]
    exchanges = [Exchange(int8_reduce_scatter(x, world_size, block), world_size) for x in inputs]
    results = [r[0] for r in simulate(exchanges)]
    n = numel // world_size
    exact = torch.stack(inputs).mean(dim=0).view(world_size, n)
    for rank in range(world_size):
        chunks = [x.view(world_size, n)[rank] for x in inputs]
        bound = torch.zeros(n)
        for chunk in chunks:
            blocks = torch.nn.functional.pad(chunk, (0, -n % block)).view(-1, block)
            step = blocks.abs().amax(dim=1) / QMAX
            bound += step.repeat_interleave(block)[:n] / 2 / world_size
        assert (results[rank] - exact[rank]).abs().le(bound * (1 + 1e-5) + 1e-7).all()


def test_int8_reduce_scatter_error_feedback_keeps_what_was_dropped() -> None:
    """With error feedback, the input plus last residual = what was sent + the new residual, exactly
    what each rank owes: over two calls the sums of sent values and of inputs differ by the residual."""
    g = torch.Generator().manual_seed(0)
    w, n = 2, 256
    inputs = [[torch.randn(w * n, generator=g) for _ in range(w)] for _ in range(2)]
    residuals = [torch.zeros(w * n) for _ in range(w)]
    sent_total = torch.zeros(w, n)
    for step in inputs:
        exchanges = [
            Exchange(int8_reduce_scatter(x, w, 64, average=False, residual=res), w)
            for x, res in zip(step, residuals, strict=True)
        ]
        sent_total += torch.stack([r[0] for r in simulate(exchanges)])
    owed = (torch.stack([x for step in inputs for x in step]).sum(0) - torch.stack(residuals).sum(0)).view(
        w, n
    )
    torch.testing.assert_close(sent_total, owed, rtol=0, atol=1e-5)


def test_int8_reduce_scatter_bytes_are_a_quarter_plus_scales() -> None:
    w, numel, block = 4, 4 * 4096, 1024
    fp32 = (w - 1) * numel * 4 // w
    assert int8_reduce_scatter_bytes(numel, w, block) == (w - 1) * (4096 + 4 * 4)
    assert int8_reduce_scatter_bytes(numel, w, block) / fp32 == pytest.approx(0.25 * (1 + 4 / block))


# -- the FSDP2 comms over real Gloo groups (threads, no processes) -----------------------------------
class _Group:
    """What FSDP2 hands a comm as ``group``: only its size is read."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_into_fills_the_output_rank_after_rank(world_size: int) -> None:
    def body(comm: Communicator) -> tuple[torch.Tensor, dict[str, float]]:
        out = torch.empty(world_size * 5)
        PackAllGather(comm)(out, torch.arange(5.0) + 10 * comm.rank, _Group(world_size))
        return out, comm.stats.snapshot()

    expected = torch.cat([torch.arange(5.0) + 10 * r for r in range(world_size)])
    for out, snap in run_in_threads(world_size, body):
        assert torch.equal(out, expected)
        assert snap["all_gather.bytes_sent"] == (world_size - 1) * 5 * 4


@pytest.mark.parametrize("compression", [None, "bf16", "fp16", "int8"])
@pytest.mark.parametrize("op", [ReduceOp.AVG, ReduceOp.SUM])
def test_pack_reduce_scatter_reduces_each_ranks_chunk(compression: str | None, op: Any) -> None:
    """Rank r ends with the average (or sum) of every rank's chunk r: fp32 exactly (sum, then the
    division), bf16/fp16 within their rounding of each input and of the sum, int8 within the bound of
    ``test_int8_reduce_scatter_is_within_half_a_step_per_rank``."""
    w, n = 3, 40
    inputs = [torch.randn(w * n, generator=torch.Generator().manual_seed(r)) for r in range(w)]

    def body(comm: Communicator) -> torch.Tensor:
        out = torch.empty(n)
        PackReduceScatter(comm, compression, block_size=16)(out, inputs[comm.rank].clone(), _Group(w), op)
        return out

    total = torch.stack(inputs).sum(dim=0).view(w, n)
    exact = total / w if op == ReduceOp.AVG else total
    tolerance = {None: 0.0, "bf16": 3e-2, "fp16": 4e-3, "int8": 4e-2}[compression]
    for rank, out in enumerate(run_in_threads(w, body)):
        torch.testing.assert_close(
            out, exact[rank], rtol=0, atol=tolerance * (1 if op == ReduceOp.AVG else w)
        )


def test_pack_reduce_scatter_refuses_a_custom_divide_factor() -> None:
    def body(comm: Communicator) -> None:
        PackReduceScatter(comm)(torch.empty(1), torch.ones(2), _Group(2), ReduceOp.MAX)

    with pytest.raises(RuntimeError, match="accepts AVG and SUM only"):
        run_in_threads(2, body)


LOSSY = ("topk", "sign", "demo")
"""Replica-sync compressors whose result is no close average (sparse, signs)."""


@pytest.mark.parametrize("sync", ["none", "int8", "powersgd", "adasum", *LOSSY])
def test_replica_sync_averages_the_shard_over_replicas(sync: str) -> None:
    """The flat shard gradient (two parameters, the second with a padded row) of two replicas: the
    average for "none" (exactly), int8 (within half a step), PowerSGD at rank 1 (the average is of
    rank 1: exact up to rounding; the per-parameter shapes reach it), Adasum of orthogonal shards
    their sum; the lossy compressors the same result on both replicas."""
    shards = [(0, torch.Size([4, 3])), (12, torch.Size([1, 3]))]  # the second padded to 2 rows

    def grad(rank: int) -> torch.Tensor:
        flat = torch.zeros(18)
        flat[rank * 6 : rank * 6 + 6] = 1.0 + rank  # rank 0: rows 0-1, rank 1: rows 2-3 of the first
        flat[12:15] = 0.5
        return flat

    def body(comm: Communicator) -> torch.Tensor:
        options = {"rank": 1, "min_compression_rate": 0} if sync == "powersgd" else {}
        compressor = make_compressor("none" if sync == "adasum" else sync, **options)
        flat = grad(comm.rank)
        ReplicaSync(comm, compressor, "fsdp0", shards, adasum=sync == "adasum")(flat)
        return flat

    results = run_in_threads(2, body)
    assert torch.equal(results[0], results[1])
    if sync in LOSSY:  # every replica gets the same (finite) approximation
        assert results[0].isfinite().all() and results[0].abs().sum() > 0
        return
    expected = (grad(0) + grad(1)) / 2
    if sync == "adasum":  # orthogonal first parameters add up; equal second ones stay
        expected = grad(0) + grad(1)
        expected[12:15] = 0.5
        expected[15:] = 0.0
    atol = {"none": 0.0, "adasum": 1e-6, "int8": 2e-2, "powersgd": 1e-6}[sync]
    torch.testing.assert_close(results[0], expected, rtol=0, atol=atol)


# -- the default policy's units, the meshes accepted (no processes) ----------------------------------
class _Tied(nn.Module):
    """A language model's layout with its head tied to its input embedding; ``nested`` puts the
    embedding inside a ``transformer`` as GPT-2 does (``transformer.wte``, ``lm_head``)."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        embed, pos = nn.Embedding(16, 8), nn.Embedding(6, 8)
        blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        if nested:
            self.transformer = nn.ModuleDict({"wte": embed, "wpe": pos, "h": blocks})
        else:
            self.embed, self.pos, self.blocks = embed, pos, blocks
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = embed.weight

    def parts(self) -> tuple[nn.Module, nn.Module, nn.ModuleList]:
        if hasattr(self, "transformer"):
            t = self.transformer
            return t["wte"], t["wpe"], t["h"]  # type: ignore[return-value]
        return self.embed, self.pos, self.blocks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embed, pos, blocks = self.parts()
        h = embed(tokens) + pos(torch.arange(tokens.shape[1]))
        for block in blocks:
            h = torch.tanh(block(h))
        return self.head(h)


class _Holder(nn.Module):
    """A LightningModule's shape: the model as its one child, no parameter of its own."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.model = _Tied(nested)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def test_default_policy_shards_tied_parameters_in_one_unit() -> None:
    """GPT-2's layout inside a LightningModule: the embedding and the head go to the model that
    holds both (the transformer, which holds the embedding but not the head, is no unit); tied
    children of a root without parameters of its own: the root; untied, every block its own unit."""
    gpt2 = _Holder(nested=True)
    t = gpt2.model.transformer
    assert plan_units(gpt2) == [t["wpe"], t["h"][0], t["h"][1], gpt2.model]
    flat = _Tied(nested=False)
    assert plan_units(flat) == [flat.pos, flat.blocks[0], flat.blocks[1], flat]
    untied = _Tied(nested=False)
    untied.head.weight = nn.Parameter(untied.head.weight.detach().clone())
    assert plan_units(untied) == [untied.embed, untied.pos, untied.blocks[0], untied.blocks[1], untied.head]


@pytest.fixture
def one_rank_group() -> Any:
    """A one-rank Gloo group in this process (a HashStore: no port), destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")  # nn.Linear on 3-D
@pytest.mark.parametrize("layout", ["gpt2", "flat"])
def test_tied_model_sharded_by_the_default_policy_has_the_unsharded_gradients(
    one_rank_group: Any, layout: str
) -> None:
    """fully_shard over one rank: the sharded model's forward and backward run (FSDP2 refuses a
    parameter in two units at the first forward) and its gradients are the plain model's, bitwise."""
    model: nn.Module = _Holder(nested=True) if layout == "gpt2" else _Tied(nested=False)
    reference = copy.deepcopy(model)
    shard_by_layer(model, one_rank_group)
    tokens = torch.randint(0, 16, (3, 6), generator=torch.Generator().manual_seed(1))
    model(tokens).square().mean().backward()
    reference(tokens).square().mean().backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    expected = {n: p.grad for n, p in reference.named_parameters()}
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert isinstance(grad, DTensor)
        assert torch.equal(grad.full_tensor(), expected[name]), name


@pytest.mark.parametrize("layout", ["gpt2", "flat"])
def test_a_users_units_that_split_a_tied_parameter_are_refused_before_training(
    one_rank_group: Any, layout: str
) -> None:
    """configure_model fully_shard-s the embedding and the head apart: GPT-2's layout (one unit around
    both: FSDP2 would refuse at the first forward) and top-level children (no unit around both: FSDP2
    would train two copies); Sharded refuses both at setup, naming the parameter's two names."""
    from lightning_dist import Sharded

    model: nn.Module = _Holder(nested=True) if layout == "gpt2" else _Tied(nested=False)
    embed = model.model.transformer["wte"] if layout == "gpt2" else model.embed
    head = model.model.head if layout == "gpt2" else model.head
    fully_shard(embed, mesh=one_rank_group)
    fully_shard(head, mesh=one_rank_group)
    if layout == "gpt2":
        fully_shard(model, mesh=one_rank_group)
    else:
        for other in (model.pos, *model.blocks):
            fully_shard(other, mesh=one_rank_group)
    prefix = "model." if layout == "gpt2" else ""
    with pytest.raises(ValueError, match="sharded into different FSDP units") as err:
        Sharded()._shard(model)
    wte = f"{prefix}transformer.wte.weight" if layout == "gpt2" else "embed.weight"
    assert f"{wte} and {prefix}head.weight" in str(err.value)
    assert "fully_shard([module_a, module_b]" in str(err.value)


class _Mesh:
    """What ``mesh_refusal`` reads of a DeviceMesh: this rank's mesh of global ranks."""

    def __init__(self, ranks: list[Any], name: str) -> None:
        self.mesh = torch.tensor(ranks)
        self.ndim = self.mesh.dim()
        self.shape = tuple(self.mesh.shape)
        self.name = name

    def size(self) -> int:
        return self.mesh.numel()

    def __repr__(self) -> str:
        return f"DeviceMesh({self.name})"


def test_a_module_is_accepted_over_any_mesh_of_the_shard_groups_ranks() -> None:
    """One replica group: device_mesh['shard'], ['data_parallel'] and the 2-D (1, 2) device_mesh
    itself are the same two ranks; FSDP2 shards over them and all-reduces over a group of one."""
    shard = _Mesh([0, 1], "shard")
    for mesh in (shard, _Mesh([0, 1], "data_parallel"), _Mesh([[0, 1]], "replicate=1, shard=2")):
        assert mesh_refusal(mesh, shard, 1, "FSDPLinear") is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ranks", "names"),
    [
        (
            [0, 1, 2, 3],
            [
                "every one of the 4 ranks",
                "Sharded(replicas=2)",
                "mesh=self.device_mesh['shard']",
                "Sharded()",
            ],
        ),
        ([[0, 1], [2, 3]], ["2-D mesh", "replica_sync", "mesh=self.device_mesh['shard']", "Sharded()"]),
        ([0, 2], ["2-rank shard mesh", "mesh=self.device_mesh['shard']"]),
    ],
)
def test_with_replica_groups_another_mesh_is_refused_with_the_reason(
    ranks: list[Any], names: list[str]
) -> None:
    """4 ranks, replicas=2, rank 0 (shard group 0, 1): the data_parallel mesh (FSDP over every rank),
    the 2-D mesh (FSDP2's own HSDP) and the replicate mesh are refused, naming the mesh to use."""
    message = mesh_refusal(_Mesh(ranks, "m"), _Mesh([0, 1], "shard"), 2, "FSDPLinear")  # type: ignore[arg-type]
    assert message is not None and message.startswith("Sharded: FSDPLinear is sharded over DeviceMesh(m)")
    for name in names:
        assert name in message


def test_torch_notes_silence_only_torchs_two_warnings_and_only_until_restored() -> None:
    """From torch.distributed only, and gone once restored (Sharded's teardown)."""
    from lightning_dist.layout import torch_notes

    view = "FSDP2-wrapped module (FSDPLinear) returned a view tensor. An in-place op ..."
    slicing = "Slicing a flattened dim from root mesh will be deprecated in PT 2.11."

    def shown(module: str) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            added = torch_notes.quiet()
            for text in (view, slicing, "another warning"):
                warnings.warn_explicit(text, UserWarning, "f.py", 1, module=module)
            torch_notes.restore(added)
            warnings.warn_explicit(view, UserWarning, "f.py", 2, module=module)
        return [str(w.message) for w in caught]

    assert shown("torch.distributed.fsdp._fully_shard._fsdp_state") == ["another warning", view]
    assert shown("my_module") == [view, slicing, "another warning", view]


# -- 2 processes ---------------------------------------------------------------------------------------
BUDGET = 240
"""Seconds for one launch (each about 60 s on 2 idle cores, 150 s with a load of 16 on them); the
slow tests' timeout is twice that."""


def launch(out: Path, devices: int, runs: list[dict[str, Any]]) -> Path:
    run_script(
        [SCRIPT, "--out", str(out), "--devices", str(devices), "--runs", json.dumps(runs)], timeout=BUDGET
    )
    return out


def two_rank_runs(ckpt: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = [
        {"name": "model_parallel", "strategy": "model_parallel", "model": "lm_user"},
        {"name": "user_policy", "model": "lm_user"},
        {"name": "none"},
        {"name": "ddp", "strategy": "ddp"},
        {"name": "bf16", "options": {"compression": "bf16"}},
        {"name": "fp16", "options": {"compression": "fp16"}},
        {"name": "int8", "options": {"compression": "int8"}},
        {"name": "replicas_only", "options": {"replicas": 2}},  # shard groups of 1: the replica hook alone
        {"name": "model_parallel_docs", "strategy": "model_parallel", "model": "lm_docs"},
        {"name": "docs", "model": "lm_docs"},
        {"name": "tied", "model": "lm_tied"},
        {"name": "tied_ddp", "strategy": "ddp", "model": "lm_tied"},
        {"name": "tied_int8", "model": "lm_tied", "options": {"compression": "int8"}},
    ]
    for run in runs:
        run["steps"] = STEPS
    # the checkpoint written in the background (the 4-process resumes write theirs at once)
    resume = {
        "options": {"compression": "int8", "error_feedback": True, "async_save": True},
        "batches_per_epoch": 4,
    }
    accumulate = {"accumulate": 2, "steps": 6}
    lightning = {"strategy": "model_parallel", "model": "lm_user", "batches_per_epoch": 4}
    runs += [
        {"name": "model_parallel_full", "epochs": 2, **lightning},
        {"name": "model_parallel_half", "epochs": 1, "save": str(ckpt.parent / "ckpt_mp"), **lightning},
        {
            "name": "from_model_parallel",
            "epochs": 2,
            "batches_per_epoch": 4,
            "resume": str(ckpt.parent / "ckpt_mp"),
        },
        {"name": "model_parallel_acc", "strategy": "model_parallel", "model": "lm_user", **accumulate},
        {"name": "none_acc", **accumulate},
        {"name": "uninterrupted", "epochs": 2, **resume},
        {"name": "first_half", "epochs": 1, "save_in_fit": str(ckpt), **resume},
        {"name": "resumed", "epochs": 2, "resume": str(ckpt), **resume},
    ]
    return runs


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The 2- and the 4-process launch, at once: their start-up (imports, process groups), most of
    their time on a shared machine, overlaps."""
    outs = {n: tmp_path_factory.mktemp(f"sharded{n}") for n in (2, 4)}
    runs = {2: two_rank_runs(outs[2] / "ckpt"), 4: four_rank_runs(outs[4] / "ckpt")}
    with ThreadPoolExecutor(len(outs)) as pool:
        for done in [pool.submit(launch, out, n, runs[n]) for n, out in outs.items()]:
            done.result()
    return outs


@pytest.fixture(scope="module")
def two_ranks(launches: dict[int, Path]) -> Path:
    return launches[2]


@pytest.fixture(scope="module")
def four_ranks(launches: dict[int, Path]) -> Path:
    return launches[4]


def weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(out / f"{name}.pt")
    return loaded


def info(out: Path, name: str, rank: int = 0) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((out / f"{name}.rank{rank}.json").read_text())
    return loaded


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert unequal == [], f"not bitwise equal: {unequal}"


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b if b[k].is_floating_point())
    den = sum(float(b[k].pow(2).sum()) for k in b if b[k].is_floating_point())
    return math.sqrt(num / den)


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_uncompressed_equals_model_parallel_strategy_and_ddp(two_ranks: Path) -> None:
    """Sharded() with the user's fully_shard calls, and with its default per-layer policy (the same
    units here), ends bitwise where Lightning's ModelParallelStrategy does; DDP ends within float
    tolerance (bitwise here: 2 ranks, a sum of two then a halving is exact either way)."""
    reference = weights(two_ranks, "model_parallel")
    assert_equal(weights(two_ranks, "user_policy"), reference)
    assert_equal(weights(two_ranks, "none"), reference)
    assert_equal(weights(two_ranks, "none_acc"), weights(two_ranks, "model_parallel_acc"))  # 2 micro-batches
    ddp = weights(two_ranks, "ddp")
    for k in reference:
        torch.testing.assert_close(ddp[k], reference[k], rtol=1e-5, atol=1e-6)
    # replicas=2 on 2 ranks: FSDP2 reduce-scatters nothing (1 rank per shard group) and the replica
    # sync averages whole gradients, as DDP does (halving then summing: bitwise at 2 ranks)
    assert_equal(weights(two_ranks, "replicas_only"), ddp)
    assert "reduce_scatter" not in info(two_ranks, "replicas_only")["bytes_by_op"]
    facts = info(two_ranks, "none")
    assert facts["fsdp_modules"] == 6  # embed, 2 blocks, norm, head, the root (pos); the encoder holds none
    by_op = facts["bytes_by_op"]
    # every gradient is reduce-scattered; every parameter is gathered for forward and again for
    # backward but the root's (pos: 32 x 32 fp32, half of it sent per gather), which FSDP2 keeps
    root_gather = 32 * 32 * 4 // 2
    assert by_op["all_gather"] == 2 * by_op["reduce_scatter"] - STEPS * root_gather


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_a_module_sharded_as_lightnings_docs_show_ends_where_model_parallel_strategy_ends(
    two_ranks: Path,
) -> None:
    """configure_model shards each layer and the model over the strategy's whole device_mesh: under
    ModelParallelStrategy that is (data_parallel=2, tensor_parallel=1), FSDP2's HSDP of two replicas
    of one shard; under Sharded (replicate=1, shard=2), two shards of one replica. Either way each
    gradient is (g0 + g1) / 2 (an exact halving of one sum) and AdamW acts elementwise: bitwise."""
    assert_equal(weights(two_ranks, "docs"), weights(two_ranks, "model_parallel_docs"))
    assert info(two_ranks, "docs")["warnings"] == []


TIED_DDP_ATOL = 1e-5
"""Sharded() against DDP() on the tied model: the same sums of two ranks' gradients (measured:
bitwise equal)."""


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_tied_embeddings_train_as_with_ddp(two_ranks: Path) -> None:
    """The embedding and the head share one weight: the default policy shards them as one unit, and
    Sharded() ends within TIED_DDP_ATOL of DDP(); the tie holds (one tensor under both names)."""
    got, ddp = weights(two_ranks, "tied"), weights(two_ranks, "tied_ddp")
    assert got.keys() == ddp.keys()
    for k in ddp:
        torch.testing.assert_close(got[k], ddp[k], rtol=0, atol=TIED_DDP_ATOL)
    assert torch.equal(got["head.weight"], got["embed.weight"])
    assert info(two_ranks, "tied")["fsdp_modules"] == 5  # 2 layers, norm, positions, the root (embed, head)


TIED_INT8_BOUND = 5e-2
"""Relative L2 distance of the tied model's int8 weights from the uncompressed run's after STEPS
(measured 1.1e-2; a margin of about 4.5, as for BOUNDS)."""


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_int8_trains_the_tied_model_within_bounds_of_uncompressed(two_ranks: Path) -> None:
    """Sharded("int8") on the tied model: its loss falls as the uncompressed run's does (measured:
    5.64 to 3.74 in 20 steps, both), ends within LOSS_BOUND of it (measured 0.08%), and its weights
    within TIED_INT8_BOUND of it."""
    int8, none = info(two_ranks, "tied_int8"), info(two_ranks, "tied")
    assert int8["train_loss"] < 0.8 * int8["first_loss"]
    assert abs(int8["train_loss"] - none["train_loss"]) < LOSS_BOUND * none["train_loss"]
    distance = relative_distance(weights(two_ranks, "tied_int8"), weights(two_ranks, "tied"))
    assert 0 < distance < TIED_INT8_BOUND


SHARDED_RUNS = ("user_policy", "none", "bf16", "int8", "replicas_only", "docs", "tied", "tied_int8")


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_torch_warnings_a_user_cannot_act_on_are_not_shown(two_ranks: Path) -> None:
    """Neither torch's mesh-slicing deprecation nor FSDP2's view-output warning reaches a user of
    Sharded, on any rank, plain module or not; the same module under ModelParallelStrategy gets
    FSDP2's (nn.Linear on a 3-D input returns a view), so the record would show it."""
    for name in SHARDED_RUNS:
        for rank in (0, 1):
            assert info(two_ranks, name, rank)["torch_warnings"] == [], (name, rank)
    lightning = info(two_ranks, "model_parallel")["torch_warnings"]
    assert any("returned a view tensor" in w for w in lightning)


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_reduce_scatters_land_after_the_call_where_fsdp2_does_not_read_them(two_ranks: Path) -> None:
    """Each step's 6 reduce-scatters (one per FSDP unit) were left in flight, compressed or not;
    with 2 micro-batches only the first one's (the second adds to the gradients FSDP2 holds, so it
    lands at once), and the runs still end bitwise where FSDP2 does (the test above)."""
    for name in ("none", "bf16", "fp16", "int8"):
        assert info(two_ranks, name)["deferred"] == 6 * STEPS, name
    assert info(two_ranks, "none_acc")["deferred"] == 6 * 6  # 6 optimizer steps of 2 micro-batches
    assert info(two_ranks, "replicas_only")["deferred"] == 0  # shard groups of 1: no reduce-scatter


# bounds on the relative L2 distance of the final weights from the uncompressed run's, after STEPS
# AdamW steps; measured: bf16 2.4e-4, fp16 1.0e-4, int8 3.7e-3. Per step, a bf16 cast errs by at
# most 2^-9 of each element, fp16 by 2^-11, int8 by half a block's step (absmax/254): a relative
# gradient error eps moves AdamW's normalised update by about eps * lr per step, and the trajectories
# then diverge chaotically, so no per-step bound carries over: the bounds are the measured distances
# with a margin of 5 to 10 (the ratios of the three stay about those of their per-step errors).
BOUNDS = {"bf16": 2e-3, "fp16": 1e-3, "int8": 2e-2}
LOSS_BOUND = 0.01
"""Final training loss within 1% of the uncompressed run's (measured: int8 0.11%, bf16/fp16 0.001%)."""


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
@pytest.mark.parametrize("compression", sorted(BOUNDS))
def test_compressed_reduce_scatter_within_bounds_of_uncompressed(two_ranks: Path, compression: str) -> None:
    reference = weights(two_ranks, "none")
    distance = relative_distance(weights(two_ranks, compression), reference)
    assert 0 < distance < BOUNDS[compression]
    loss, ref_loss = info(two_ranks, compression)["train_loss"], info(two_ranks, "none")["train_loss"]
    assert abs(loss - ref_loss) < LOSS_BOUND * ref_loss
    sent = info(two_ranks, compression)["bytes_by_op"]
    fp32 = info(two_ranks, "none")["bytes_by_op"]["reduce_scatter"]
    if compression == "int8":  # the int8 values plus one fp32 scale per block, counted by the communicator
        assert 0.25 < sent["all_to_all"] / fp32 < 0.26
        assert "reduce_scatter" not in sent
    else:
        assert sent["reduce_scatter"] * 2 == fp32


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_resumes_a_model_parallel_strategy_checkpoint(two_ranks: Path) -> None:
    """A user moving from Lightning's ModelParallelStrategy: Sharded (default policy, the same units)
    continues its distributed checkpoint where ModelParallelStrategy itself would, without a warning."""
    assert_equal(weights(two_ranks, "from_model_parallel"), weights(two_ranks, "model_parallel_full"))
    assert info(two_ranks, "from_model_parallel")["warnings"] == []


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_stop_and_resume_equals_the_uninterrupted_run_bitwise(two_ranks: Path) -> None:
    """int8 with error feedback: the residuals are per-rank state in the distributed checkpoint,
    written in the background (``async_save=True``)."""
    assert_equal(weights(two_ranks, "resumed"), weights(two_ranks, "uninterrupted"))
    assert info(two_ranks, "resumed")["warnings"] == []
    assert sorted(p.name for p in (two_ranks / "ckpt").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]


# -- 4 processes: HSDP 2 x 2 ---------------------------------------------------------------------------
def four_rank_runs(ckpt: Path) -> list[dict[str, Any]]:
    one_step = {"model": "mlp", "steps": 1, "record": True}
    powersgd = {
        "model": "mlp",
        "batches_per_epoch": 2,
        "options": {"replicas": 2, "replica_sync": "powersgd"},
    }
    int8 = {
        "model": "mlp",
        "batches_per_epoch": 2,
        "options": {"compression": "int8", "error_feedback": True},
    }
    int8_hsdp = {**int8, "options": {"compression": "int8", "error_feedback": True, "replicas": 2}}
    return [
        {"name": "fsdp4", **one_step},
        {"name": "hsdp_none", "options": {"replicas": 2}, **one_step},
        {"name": "hsdp_int8", "options": {"replicas": 2, "replica_sync": "int8"}, **one_step},
        {"name": "hsdp_adasum", "options": {"replicas": 2, "reduce_op": "adasum"}, **one_step},
        # PowerSGD across replicas (state: factors, error feedback), stopped and resumed
        {"name": "hsdp_powersgd", "epochs": 2, **powersgd},
        {"name": "hsdp_powersgd_half", "epochs": 1, "save": str(ckpt), **powersgd},
        {"name": "hsdp_powersgd_resumed", "epochs": 2, "resume": str(ckpt), **powersgd},
        # 4 shards (int8 with error feedback) resumed at 2 shards x 2 replicas: no step left to run,
        # so the weights are the loaded ones
        {"name": "four_shards", "epochs": 1, "save": str(ckpt.parent / "ckpt_int8"), **int8},
        {"name": "resharded", "epochs": 1, "resume": str(ckpt.parent / "ckpt_int8"), **int8_hsdp},
    ]


def mlp_gradients(out: Path, name: str, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial weights, the gradient of rank ``rank``'s recorded batch at them), in one process."""
    recorded = torch.load(out / f"{name}.rank{rank}.batches.pt")
    initial = recorded["initial"]
    layers: list[nn.Module] = []
    for i in range(len(MLP_SIZES) - 1):
        layers += [nn.Linear(MLP_SIZES[i], MLP_SIZES[i + 1]), nn.Tanh()]
    net = nn.Sequential(*layers[:-1])
    net.load_state_dict({k.removeprefix("net."): v for k, v in initial.items()})
    (x, y), *_ = recorded["batches"]
    nn.functional.mse_loss(net(x), y).backward()
    return initial, {f"net.{k}": p.grad for k, p in net.named_parameters()}  # type: ignore[misc]


def shard(t: torch.Tensor, k: int, shards: int = 2) -> torch.Tensor:
    """FSDP2's shard k of ``t``: its k-th dim-0 chunk, padded to ceil(rows / shards) rows."""
    rows = -(-t.shape[0] // shards)
    chunks = torch.chunk(t, shards, dim=0)
    part = chunks[k] if k < len(chunks) else t[:0]
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *t.shape[1:])])


def shard_rows(t: torch.Tensor, k: int, shards: int = 2) -> int:
    """Rows of shard k of ``t`` without padding."""
    chunks = torch.chunk(t, shards, dim=0)
    return chunks[k].shape[0] if k < len(chunks) else 0


def unshard(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    return torch.cat(parts)[:rows]


def int8_average(flats: list[torch.Tensor], chunk: int = 1024) -> torch.Tensor:
    """Int8Quantization at 2 ranks, written out: each rank's vector in blocks of ``chunk`` with
    scale = absmax / 127, values round(x / scale), and every rank sums the dequantised halves."""
    n = flats[0].numel()
    total = torch.zeros(-(-n // chunk) * chunk)
    for x in flats:
        blocks = nn.functional.pad(x, (0, total.numel() - n)).view(-1, chunk)
        scale = torch.maximum(blocks.amax(dim=1), -blocks.amin(dim=1)) / QMAX
        q = (blocks * torch.where(scale > 0, 1 / scale, 0).unsqueeze(1)).round()
        total += (q * (scale / len(flats)).unsqueeze(1)).view(-1)
    return total[:n]


def adasum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors (float64): (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b."""
    a64, b64 = a.double(), b.double()
    dot = (a64 * b64).sum()
    return ((1 - dot / (2 * a64.pow(2).sum())) * a64 + (1 - dot / (2 * b64.pow(2).sum())) * b64).float()


def hsdp_reference(out: Path, name: str, sync: str) -> dict[str, torch.Tensor]:
    """One SGD step of HSDP 2x2, written out: rank = 2 * replica + shard; each replica group averages
    its two ranks' gradients (the reduce-scatter), then each shard's two replicas are combined by
    ``sync`` per FSDP unit (one Linear: its weight's and bias's shards, flat) or, for Adasum, per
    parameter shard; the weights step by -lr times the result."""
    grads = []
    initial: dict[str, torch.Tensor] = {}
    for rank in range(4):
        initial, g = mlp_gradients(out, name, rank)
        grads.append(g)
    replica = [{k: (grads[2 * r][k] + grads[2 * r + 1][k]) / 2 for k in grads[0]} for r in range(2)]
    new: dict[str, torch.Tensor] = {}
    for layer in ("net.0", "net.2", "net.4"):
        names = [f"{layer}.weight", f"{layer}.bias"]
        synced: dict[str, list[torch.Tensor]] = {k: [] for k in names}
        for k_shard in range(2):
            parts = [[shard(replica[r][k], k_shard) for k in names] for r in range(2)]
            if sync == "adasum":  # each parameter's shard without its padding
                combined = []
                for i, k in enumerate(names):
                    rows = shard_rows(initial[k], k_shard)
                    mixed = parts[0][i].clone()
                    mixed[:rows] = adasum(parts[0][i][:rows], parts[1][i][:rows])
                    combined.append(mixed)
            else:
                flats = [torch.cat([p.reshape(-1) for p in ps]) for ps in parts]
                flat = int8_average(flats) if sync == "int8" else (flats[0] / 2 + flats[1] / 2)
                sizes = [p.numel() for p in parts[0]]
                combined = [c.view_as(p) for c, p in zip(flat.split(sizes), parts[0], strict=True)]
            for k, c in zip(names, combined, strict=True):
                synced[k].append(c)
        for k in names:
            grad = unshard(synced[k], initial[k].shape[0])
            new[k] = initial[k].add(grad, alpha=-MLP_LR)
    return new


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
@pytest.mark.parametrize("sync", ["int8", "adasum"])
def test_hsdp_replica_sync_equals_the_written_out_step(four_ranks: Path, sync: str) -> None:
    name = f"hsdp_{sync}"
    expected = hsdp_reference(four_ranks, name, sync)
    got = weights(four_ranks, name)
    for k in expected:
        # int8: the same operations in the same order (bitwise here); Adasum: float64 dot products
        # summed in another order than the pack's, then rounded to float32
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0 if sync == "int8" else 1e-6)
    by_op = info(four_ranks, name)["bytes_by_op"]
    assert by_op["reduce_scatter"] > 0 and by_op["all_gather"] > 0  # inside each replica group
    assert by_op["adasum" if sync == "adasum" else "all_gather"] > 0  # across them


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_hsdp_replica_syncs_land_after_their_reduce_scatters(four_ranks: Path) -> None:
    """One step of the 3-unit MLP: 3 reduce-scatters left in flight, and as many replica syncs
    behind them, but Adasum's (it waits for its reduce-scatter and syncs at once)."""
    expected = {"fsdp4": 3, "hsdp_none": 6, "hsdp_int8": 6, "hsdp_adasum": 3}
    assert {name: info(four_ranks, name)["deferred"] for name in expected} == expected


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_hsdp_uncompressed_equals_fsdp_over_every_rank(four_ranks: Path) -> None:
    """Averaging inside the shard group, then across replicas, is the 4-rank average (up to the
    rounding of (a + b) / 2 + (c + d) / 2 against (a + b + c + d) / 4)."""
    reference = weights(four_ranks, "fsdp4")
    got = weights(four_ranks, "hsdp_none")
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=0, atol=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_hsdp_stop_and_resume_equals_the_uninterrupted_run_bitwise(four_ranks: Path) -> None:
    """The replica-sync compressor's state (PowerSGD's factors and error feedback) is per-rank state
    in the distributed checkpoint; PowerSGD sends less than the uncompressed replica sync."""
    assert_equal(weights(four_ranks, "hsdp_powersgd_resumed"), weights(four_ranks, "hsdp_powersgd"))
    assert info(four_ranks, "hsdp_powersgd_resumed")["warnings"] == []
    assert not torch.equal(
        weights(four_ranks, "hsdp_powersgd")["net.0.weight"], weights(four_ranks, "fsdp4")["net.0.weight"]
    )


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_resume_at_another_shard_count_loads_the_weights_and_names_what_it_dropped(four_ranks: Path) -> None:
    assert_equal(weights(four_ranks, "resharded"), weights(four_ranks, "four_shards"))
    (warning,) = info(four_ranks, "resharded")["warnings"]  # once, by rank 0
    assert "written at world size 4 with replicas=1, this run has 4 and 2" in warning
    assert "error-feedback residuals" in warning and "dropped" in warning
