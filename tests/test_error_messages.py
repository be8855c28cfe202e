"""Errors say what is wrong and what to do: each test matches the improved text of one message (so it
fails on the old one). All fast and in one process: no process group except a one-rank Gloo group
made from a HashStore."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dist.algorithms.diloco_outer import OuterSGD
from lightning_dist.algorithms.diloco_params import foreign_parameter_message
from lightning_dist.cluster import netns
from lightning_dist.collectives import Communicator, TorchBackend
from lightning_dist.collectives.adasum import adasum_reference
from lightning_dist.collectives.exchanges import start_round
from lightning_dist.collectives.single import SingleProcessBackend
from lightning_dist.compression import make_compressor, simulate
from lightning_dist.compression.packing import pack, unpack
from lightning_dist.strategies.diloco import DiLoCo


# -- DiLoCo: a parameter of the optimizer that is not the module's ---------------------------------
class Unregistered(nn.Module):
    """A registered Linear, and one kept in a plain list (nn.Module does not register it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.heads = [nn.Linear(2, 4)]


def test_diloco_foreign_parameter_names_it_its_shape_dtype_and_the_fix() -> None:
    module = Unregistered()
    opt = torch.optim.SGD([*module.parameters(), *module.heads[0].parameters()], lr=0.1)
    group = opt.param_groups[0]
    message = foreign_parameter_message(module, module.heads[0].weight, 0, group)
    assert "param_groups[0]['params'][2]" in message
    assert "the module's unregistered 'heads[0].weight'" in message
    assert "shape (4, 2), dtype torch.float32" in message
    assert "build it from self.parameters()" in message and "configure_optimizers" in message


def test_diloco_foreign_parameter_named_by_the_optimizer() -> None:
    """An optimizer built from named parameters (torch >= 2.6) knows the name the module does not."""
    module, other = nn.Linear(3, 2), nn.Linear(5, 1, dtype=torch.float64)
    opt = torch.optim.SGD([*module.named_parameters(), ("other.bias", other.bias)], lr=0.1)
    if "param_names" not in opt.param_groups[0]:
        pytest.skip("this torch keeps no param_names")
    message = foreign_parameter_message(module, other.bias, 0, opt.param_groups[0])
    assert "named 'other.bias' in the optimizer's param_names" in message
    assert "shape (1,), dtype torch.float64" in message


def test_diloco_setup_raises_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DiLoCo.setup`` raises it (DDP's own setup stubbed out: no process group)."""
    module = Unregistered()
    strategy = DiLoCo(inner_steps=2)
    monkeypatch.setattr(DiLoCo.__mro__[1], "setup", lambda self, trainer: None)
    monkeypatch.setattr(DiLoCo, "lightning_module", property(lambda self: module))
    strategy.optimizers = [torch.optim.SGD([*module.parameters(), *module.heads[0].parameters()], lr=0.1)]

    class Trainer:
        class state:
            fn = "fit"

    with pytest.raises(ValueError, match=r"'heads\[0\]\.weight'.*shape \(4, 2\).*self\.parameters\(\)"):
        strategy.setup(Trainer())  # type: ignore[arg-type]


# -- DiLoCo: a checkpoint's outer state for other parameters ---------------------------------------
def _outer(*shapes: tuple[int, ...], names: tuple[str, ...] = ("a", "b", "c")) -> OuterSGD:
    params = [(n, nn.Parameter(torch.zeros(s))) for n, s in zip(names, shapes, strict=False)]
    return OuterSGD(params, lr=0.7, momentum=0.9, nesterov=True)


def test_outer_state_mismatch_names_missing_extra_and_counts() -> None:
    state = _outer((2,), (3,), (4,)).state_dict()
    with pytest.raises(ValueError) as info:
        _outer((2,), (3,), names=("a", "z")).load_state_dict(state)
    message = str(info.value)
    assert "it holds 3 parameters, this model's optimizer 2" in message
    assert "missing z" in message and "extra b, c (not in this model's optimizer)" in message
    assert "Resume with the model and configure_optimizers of the run that saved it" in message
    assert "'lightning_dist.diloco' entry" in message


def test_outer_state_mismatch_names_other_shapes() -> None:
    """Shapes were not checked before (a (1,) anchor broadcast silently into a (3,) parameter)."""
    state = _outer((2, 2), (1,)).state_dict()
    with pytest.raises(
        ValueError, match=r"other shapes: a \(2, 2\) in the checkpoint, \(4,\) here, b \(1,\) in"
    ):
        _outer((4,), (3,)).load_state_dict(state)


def test_diloco_inner_steps_change_is_logged_with_what_to_pass(caplog: pytest.LogCaptureFixture) -> None:
    cpu = [torch.device("cpu")]
    saved_by = DiLoCo(inner_steps=4, parallel_devices=cpu)
    module = nn.Linear(3, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    saved_by.optimizers = [opt]
    saved_by.outer = OuterSGD(list(module.named_parameters()), 0.7, 0.9, True)
    saved_by.inner_step = 3
    checkpoint = {"optimizer_states": [opt.state_dict()], "state_dict": module.state_dict()}
    checkpoint.update(saved_by.checkpoint_entry(checkpoint))

    resumed = DiLoCo(inner_steps=8, parallel_devices=cpu)
    resumed.optimizers = [opt]
    resumed.outer = OuterSGD(list(module.named_parameters()), 0.7, 0.9, True)
    with caplog.at_level(logging.INFO, logger="lightning_dist.strategies.diloco"):
        resumed.load_optimizer_state_dict(checkpoint)
    assert "saved with inner_steps=4, this run has inner_steps=8" in caplog.text
    assert "the 3 inner steps since the last sync carry over" in caplog.text
    assert "pass DiLoCo(inner_steps=4) to keep the saved schedule" in caplog.text


# -- collectives -----------------------------------------------------------------------------------
def test_torch_backend_without_a_process_group_says_how_to_get_one() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError) as info:
        TorchBackend()
    message = str(info.value)
    assert "TorchBackend(group=None)" in message
    assert "L.Trainer(strategy=DDP())" in message
    assert "torch.distributed.init_process_group(" in message
    assert "pass group=" in message


def test_torch_backend_with_a_group_needs_no_default_group() -> None:
    """The fix the message names: an explicit group works without init_process_group."""
    group = torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)
    assert TorchBackend(group).transport == "gloo"


@pytest.mark.parametrize("call", ["send", "recv"])
def test_single_process_point_to_point_names_the_peer_and_the_fix(call: str) -> None:
    backend = SingleProcessBackend()
    with pytest.raises(RuntimeError, match=rf"{call}\((dst|src)=1\): there is no peer at world size 1.*"
                       r"if comm.world_size > 1"):  # fmt: skip
        getattr(backend, call)(torch.zeros(2), 1)


def test_adasum_reference_names_the_counts_per_rank() -> None:
    with pytest.raises(ValueError, match=r"holds \[2, 1\] tensors per rank; pass the same number"):
        adasum_reference([[torch.ones(2), torch.ones(2)], [torch.ones(2)]])


def test_reduce_scatter_says_how_to_fit_the_world_size() -> None:
    class Two(SingleProcessBackend):
        world_size = 2  # type: ignore[assignment]

    with pytest.raises(ValueError, match=r"pad it to a multiple of 2, or pass a list of 2 tensors"):
        Communicator(Two()).reduce_scatter_async(torch.zeros(3))


def test_start_round_on_a_finished_exchange_says_what_to_read() -> None:
    ex = make_compressor("none").exchange("k", torch.ones(4))
    ex.run_local()
    with pytest.raises(RuntimeError, match=r"its round is None.*read exchange\.result"):
        start_round(None, [ex])  # type: ignore[arg-type]


def test_lockstep_exchanges_of_other_rounds_are_named() -> None:
    group = [
        make_compressor("none").exchange("a", torch.ones(64), world_size=2),
        make_compressor("topk").exchange("b", torch.ones(64), world_size=2),
    ]
    with pytest.raises(RuntimeError, match=r"\['allreduce/sum', 'allgather/sum'\]; put exchanges"):
        start_round(None, group)  # type: ignore[arg-type]


# -- compression -----------------------------------------------------------------------------------
def test_run_local_on_a_multi_rank_exchange_says_how_to_drive_it() -> None:
    ex = make_compressor("none").exchange("k", torch.ones(4), world_size=2)
    with pytest.raises(RuntimeError, match=r"world size 2; run_local finishes one started with world_size=1"):
        ex.run_local()


def test_simulate_names_each_ranks_round() -> None:
    exchanges = [
        make_compressor("none").exchange("k", torch.ones(64), world_size=2, rank=0),
        make_compressor("topk").exchange("k", torch.ones(64), world_size=2, rank=1),
    ]
    with pytest.raises(RuntimeError, match=r"\['allreduce/sum', 'allgather/sum'\], by rank"):
        simulate(exchanges)


def test_compressor_state_of_another_compressor_says_where_it_loads() -> None:
    state = make_compressor("topk").state_dict()
    with pytest.raises(ValueError, match=r"load it into make_compressor\('topk'\), or call reset\(\)"):
        make_compressor("powersgd").load_state_dict(state)
    with pytest.raises(ValueError, match=r"pass the state_dict\(\) of every old rank's powersgd only"):
        make_compressor("powersgd").merge_states([state])


def test_unpack_with_other_specs_names_them() -> None:
    buf = pack([torch.zeros(2, 8, dtype=torch.float32)])
    with pytest.raises(ValueError, match=r"for specs \[\(torch.float32, 4\)\]; unpack with the specs"):
        unpack(buf, [(torch.float32, 4)])


# -- launch ----------------------------------------------------------------------------------------
def test_cluster_down_failure_names_the_command_that_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = netns.EmulatedCluster(2, prefix="ldtest")
    cluster.is_up = True

    def refuse(namespace: str) -> Any:
        raise RuntimeError(f"could not delete network namespace {namespace}: busy")

    monkeypatch.setattr(netns, "list_namespaces", lambda: list(cluster.namespaces))
    monkeypatch.setattr(netns, "_delete_namespace", refuse)
    with pytest.raises(RuntimeError) as info:
        cluster.down()
    message = str(info.value)
    assert "down() left namespaces behind: could not delete network namespace ldtest-node0: busy" in message
    assert "python -m lightning_dist.cluster.netns down --prefix ldtest" in message


# -- DiLoCo's family: outer_momentum's range, ShardedDiLoCo's shard_compression --------------------
@pytest.mark.parametrize("value", [1.5, 1, 1.0, -0.1, float("nan"), "0.9"])
@pytest.mark.parametrize("family", ["DiLoCo", "ShardedDiLoCo", "ElasticDiLoCo", "FaultTolerantDiLoCo"])
def test_outer_momentum_names_the_range_it_accepts(family: str, value: Any) -> None:
    """1 is refused, so the message says [0, 1), for every value and every strategy that takes it."""
    import lightning_dist

    if family == "FaultTolerantDiLoCo":
        pytest.importorskip("torchft")
    with pytest.raises(ValueError, match=rf"^outer_momentum={value!r} must be in \[0, 1\)$"):
        getattr(lightning_dist, family)(outer_momentum=value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"shard_compression": "zip"},
            r"^shard_compression='zip' is not supported; accepted: None, 'bf16', 'fp16', 'int8'$",
        ),
        (
            {"error_feedback": True},
            r"^error_feedback=True needs shard_compression='int8' \(got shard_compression=None\); "
            r"accepted: error_feedback=False, or shard_compression='int8'$",
        ),
    ],
)
def test_sharded_diloco_names_shard_compression(kwargs: dict[str, Any], message: str) -> None:
    """ShardedDiLoCo's own name for Sharded's compression (its compression is the pseudo-gradients')."""
    from lightning_dist import ShardedDiLoCo

    with pytest.raises(ValueError, match=message):
        ShardedDiLoCo(**kwargs)
