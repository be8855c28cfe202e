"""Every strategy of the pack and its references on 2 emulated nodes, at capped links.

    sudo python benchmarks/bench_cluster.py      # everything: 18 rows x 4 caps x 2 models x 3 rounds = 432 runs,
                                                 # about 1.5 h on 2 quiet cores, most of it process start-up
    sudo python benchmarks/bench_cluster.py --steps 3 --rounds 1 --caps none 100mbit --rows ddp torch_ddp  # ~1 min
    sudo python benchmarks/bench_cluster.py --models mlp --caps 1gbit 100mbit --rows torch_ddp ld_ddp c_powersgd

Root only (it builds network namespaces: ``lightning_dist.cluster.netns.EmulatedCluster``, two nodes
joined by one veth pair, ``tc tbf`` on both ends for a cap). Per cap one cluster is built; inside it
each round runs every (model, row) once, rows in an order rotated each round, so a shared machine's
noise spreads over all rows. Every run is one fresh process per node (1 thread each): Gloo rows via
``run_each``, Horovod rows via mpirun across the namespaces (MPI controller, ``--bind-to none``).
A run trains ``--warmup`` + ``--steps`` optimizer steps; only the last ``--steps`` are timed, so the
processes' start-up (imports, rendezvous, first-touch allocations, PowerSGD's warm-up) stays out.

Models: ``workload`` (the embedded byte-level LM, its AdamW, 16 x 128 tokens per rank; Compressed demo
uses plain SGD with the same lr, as in bench_compression.py; the Lightning module's per-step
``self.log(sync_dist=True)`` is dropped so every row does only the gradient exchange) and ``mlp``
(4 x Linear(1024,1024)+ReLU, Kaiming-normal init, and a Linear(1024,10) head, 4.2M parameters, batch
32 per rank, SGD lr 0.03 (Compressed demo: lr 1e-3, its update is a sign), 10 classes of Gaussian
points around fixed random centres).

Rows: the pack's DDP(), DDP(reduce_op="adasum"), Horovod(), HorovodAdasum(), Compressed(c) for each
compressor; Lightning's own DDPStrategy ("ddp"); raw torch DistributedDataParallel over Gloo with no
hook, torch's fp16_compress_hook and powerSGD_hook rank 4 (one bucket: it breaks on Gloo with more);
Horovod's own loop (hvd.DistributedOptimizer) with average, fp16 compression and Adasum. Horovod lr
rule as Horovod() applies it: average x world size, Adasum x local size (1 here).

Per row and cap: median step time over every timed step of every round, its IQR, the ratio to raw
torch DDP at the same cap, bytes sent per step by rank 0 (a) from the pack's collectives counters
(pack strategies only) and (b) on the wire: the tx bytes of rank 0's veth (/proc/net/dev in its
namespace) over the timed steps, headers included, for every row; the link-limit time for (b) at the
cap (what tbf lets through: the floor for that step), and the loss on a fixed evaluation set after
(warmup + steps) x batch x 2 samples. Writes OUT/cluster.md, OUT/cluster.json and OUT/cluster.png;
with ``--timeline DIR`` also a Timeline (Chrome trace of both ranks) of every pack run in DIR, and
Horovod's own timeline (rank 0's engine: negotiation, fusion, MPI calls) of every mpirun run,
Horovod's loop included, as ``*.horovod.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent


# -- rows, models, caps ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the table: how the two ranks are started and what they train with."""

    key: str
    label: str
    kind: str
    """'lightning' (a Lightning Trainer), 'torch' (raw torch DDP loop) or 'hvd_loop' (Horovod's loop)."""
    mpirun: bool = False
    """Started by mpirun across the nodes (Horovod) instead of one process per node."""
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def ours(self) -> bool:
        """A strategy of the pack: its bytes go through the collectives counters."""
        return self.key.startswith(("ld_", "horovod", "c_"))


ROWS: dict[str, Row] = {
    r.key: r
    for r in [
        Row("ld_ddp", "DDP()", "lightning"),
        Row("ld_ddp_adasum", "DDP(reduce_op='adasum')", "lightning"),
        Row("horovod", "Horovod() (mpirun)", "lightning", mpirun=True),
        Row("horovod_adasum", "HorovodAdasum() (mpirun)", "lightning", mpirun=True),
        Row("c_fp16", "Compressed('fp16')", "lightning", options={"compressor": "fp16"}),
        Row("c_bf16", "Compressed('bf16')", "lightning", options={"compressor": "bf16"}),
        Row("c_int8", "Compressed('int8')", "lightning", options={"compressor": "int8"}),
        Row("c_powersgd", "Compressed('powersgd', rank=4)", "lightning", options={"compressor": "powersgd", "rank": 4, "warmup": 0}),
        Row("c_topk", "Compressed('topk', ratio=0.01)", "lightning", options={"compressor": "topk", "ratio": 0.01}),
        Row("c_sign", "Compressed('sign')", "lightning", options={"compressor": "sign"}),
        Row("c_demo", "Compressed('demo') (SGD)", "lightning", options={"compressor": "demo"}),
        Row("ddp", "Lightning DDPStrategy 'ddp'", "lightning"),
        Row("torch_ddp", "torch DDP, Gloo, no hook (reference)", "torch"),
        Row("torch_fp16", "torch DDP + fp16_compress_hook", "torch", options={"hook": "fp16"}),
        Row("torch_powersgd", "torch DDP + powerSGD_hook rank 4, 1 bucket", "torch", options={"hook": "powersgd"}),
        Row("hvd_loop", "Horovod loop, average", "hvd_loop", mpirun=True, options={"op": "average"}),
        Row("hvd_loop_fp16", "Horovod loop, fp16 compression", "hvd_loop", mpirun=True, options={"op": "fp16"}),
        Row("hvd_loop_adasum", "Horovod loop, Adasum", "hvd_loop", mpirun=True, options={"op": "adasum"}),
    ]
}  # fmt: skip
REFERENCE = "torch_ddp"
MODELS = {
    "workload": "embedded workload (byte LM, AdamW, 16 x 128 tokens/rank)",
    "mlp": "MLP 4 x Linear(1024,1024)+ReLU + head (4.2M params, batch 32/rank, SGD)",
}
MLP_LR = 0.03
MLP_DEMO_LR = 1e-3
DEFAULT_CAPS = ["none", "10gbit", "1gbit", "100mbit"]
_UNITS = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}


def parse_cap(text: str) -> Optional[float]:
    """'none' -> None (no tbf); '10gbit', '100mbit', '500kbit' or a bare number of Mbit/s -> Mbit/s."""
    t = text.strip().lower()
    if t in ("none", "0", "off", "uncapped"):
        return None
    for unit, scale in _UNITS.items():
        if t.endswith(unit):
            t, factor = t[: -len(unit)], scale
            break
    else:
        factor = 1.0
    try:
        value = float(t) * factor
    except ValueError:
        value = float("nan")
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(
            f"cap {text!r}: accepted 'none', a rate like '10gbit', '100mbit', '500kbit', or Mbit/s as a number"
        )
    return value


def cap_label(mbit: Optional[float]) -> str:
    if mbit is None:
        return "none"
    if mbit >= 1000 and mbit % 1000 == 0:
        return f"{mbit / 1000:g} Gbit/s"
    return f"{mbit:g} Mbit/s"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--caps", nargs="+", type=parse_cap, default=[parse_cap(c) for c in DEFAULT_CAPS],
                   help="link caps: none, 10gbit, 1gbit, 100mbit, ... (default: %(default)s Mbit/s)")  # fmt: skip
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), metavar="ROW",
                   help=f"subset of rows (default all): {', '.join(ROWS)}")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--replot", action="store_true", help="only redraw cluster.png from --out's cluster.json")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first in each run (default 3)")
    p.add_argument(
        "--out", default=str(BENCH_DIR / "results"), help="output folder (default benchmarks/results)"
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default 120 + 30 per step)")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="also write a Timeline (Chrome trace, both ranks) of every pack run to DIR, and "
                        "Horovod's own timeline of every mpirun run (*.horovod.json)")  # fmt: skip
    p.add_argument("--timeline-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    a = checked_counts(p, p.parse_args(argv))
    a.caps = list(dict.fromkeys(a.caps))
    return a


def checked_counts(p: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """``a`` with --rounds, --steps >= 1 and --warmup >= 0 checked (else ``p.error``) and --rows
    without repeats."""
    for name, low in (("rounds", 1), ("steps", 1), ("warmup", 0)):
        if getattr(a, name) < low:
            p.error(f"--{name}={getattr(a, name)} must be >= {low}")
    a.rows = list(dict.fromkeys(a.rows))
    return a


# -- the worker: one rank of one run ------------------------------------------------------------------


def _tx_bytes() -> int:
    """Bytes sent so far on this namespace's cluster interface (GLOO_SOCKET_IFNAME; else all but lo)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    total = 0
    with open("/proc/net/dev") as fh:
        for line in fh.readlines()[2:]:
            name, _, rest = line.partition(":")
            name = name.strip()
            if (ifname and name == ifname) or (not ifname and name != "lo"):
                total += int(rest.split()[8])
    return total


def build_model(name: str, row: Row) -> Any:
    """The LightningModule of ``name`` (raw loops use it as a plain nn.Module: same init, data, loss)."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset
    from typing_extensions import override

    if name == "workload":
        from lightning_dist.workload import TinyCausalLM, WorkloadConfig
        from lightning_dist.workload.data import TextBlocks, load_corpus

        class BenchLM(TinyCausalLM):
            """The workload without the per-step ``sync_dist`` log (the raw loops have none)."""

            @override
            def training_step(self, batch: Any, batch_idx: int) -> Any:
                return self._loss(batch)[0]

            @override
            def configure_optimizers(self) -> Any:
                if row.options.get("compressor") == "demo":
                    return torch.optim.SGD(self.parameters(), lr=self.config.lr)
                return super().configure_optimizers()

            def loss_of(self, forward: Any, batch: Any) -> Any:
                x, y = batch
                return nn.functional.cross_entropy(forward(x).flatten(0, 1).float(), y.flatten())

            def eval_batches(self) -> list[Any]:
                data = TextBlocks(load_corpus("val", self.config.val_bytes), self.config.seq_len)
                return list(DataLoader(data, batch_size=self.config.batch_size))[:4]

            @property
            def per_rank_batch(self) -> int:
                return self.config.batch_size

        return BenchLM(WorkloadConfig(seed=1234))

    class Clusters(Dataset):
        """Class ``i % 10`` for sample ``i``: Gaussian noise (one generator per index) plus 0.3 x that
        class's fixed random centre; learnable within the few steps a run takes."""

        def __init__(self, n: int, offset: int = 0) -> None:
            self.n, self.offset = n, offset
            self.centres = 0.3 * torch.randn(10, 1024, generator=torch.Generator().manual_seed(99))

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> Any:
            i += self.offset
            x = torch.randn(1024, generator=torch.Generator().manual_seed(i))
            return x + self.centres[i % 10], i % 10

    class MLP(L.LightningModule):
        per_rank_batch = 32

        def __init__(self, samples: int) -> None:
            super().__init__()
            self.samples = samples
            torch.manual_seed(1234)
            layers: list[nn.Module] = []
            for _ in range(4):
                linear = nn.Linear(1024, 1024)
                nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")  # activations keep their scale
                nn.init.zeros_(linear.bias)
                layers += [linear, nn.ReLU()]
            self.net = nn.Sequential(*layers, nn.Linear(1024, 10))

        @override
        def forward(self, x: Any) -> Any:
            return self.net(x)

        def loss_of(self, forward: Any, batch: Any) -> Any:
            x, y = batch
            return nn.functional.cross_entropy(forward(x), y)

        @override
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.loss_of(self, batch)

        @override
        def configure_optimizers(self) -> Any:
            # DeMo's update is a sign per element: a step of lr on every weight needs a smaller lr
            return torch.optim.SGD(
                self.parameters(), lr=MLP_DEMO_LR if row.options.get("compressor") == "demo" else MLP_LR
            )

        @override
        def train_dataloader(self) -> Any:
            return DataLoader(
                Clusters(self.samples), batch_size=self.per_rank_batch, shuffle=True, drop_last=True
            )

        def eval_batches(self) -> list[Any]:
            return list(DataLoader(Clusters(512, offset=10**7), batch_size=128))

    return MLP(2 * 32 * 4096)


def _eval_loss(module: Any) -> float:
    import torch

    module.eval()
    with torch.no_grad():
        losses = [float(module.loss_of(module, b)) for b in module.eval_batches()]
    return sum(losses) / len(losses)


def _lightning_strategy(row: Row) -> Any:
    import lightning_dist

    if row.key == "ddp":
        return "ddp"
    if row.key == "ld_ddp":
        return lightning_dist.DDP()
    if row.key == "ld_ddp_adasum":
        return lightning_dist.DDP(reduce_op="adasum")
    if row.key == "horovod":
        return lightning_dist.Horovod()
    if row.key == "horovod_adasum":
        return lightning_dist.HorovodAdasum()
    options = dict(row.options)
    return lightning_dist.Compressed(options.pop("compressor"), log_stats=False, **options)


def run_lightning(row: Row, a: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from typing_extensions import override

    from lightning_dist import collectives
    from lightning_dist.callbacks import CommMonitor
    from lightning_dist.workload.trainer import quiet_trainer

    class Wire(L.Callback):
        def __init__(self) -> None:
            self.marks: list[int] = []

        @override
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if idx == a.warmup:
                self.marks.append(_tx_bytes())

        @override
        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
        ) -> None:
            if idx == a.warmup + a.steps - 1:
                self.marks.append(_tx_bytes())

    L.seed_everything(1234, verbose=False)  # PL_GLOBAL_SEED: the DistributedSampler's seed, as in the loops
    module = build_model(a.model, row)
    monitor, wire = CommMonitor(warmup=a.warmup, log=False), Wire()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=1 if row.mpirun else 2,
        strategy=_lightning_strategy(row),
        max_steps=a.warmup + a.steps,
        limit_val_batches=0,
        callbacks=[monitor, wire, *_timeline(a)],
    )
    trainer.fit(module)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "step_seconds": monitor.step_seconds[a.warmup :],
        "counted_bytes": statistics.median(monitor.bytes_sent[a.warmup :]) if row.ours else None,
        "wire_bytes": (wire.marks[1] - wire.marks[0]) / a.steps if len(wire.marks) == 2 else None,
    }
    if trainer.global_rank == 0:
        result["loss"] = _eval_loss(module)
    collectives.shutdown()
    return result


def _timeline(a: argparse.Namespace) -> list[Any]:
    if not a.timeline_out:
        return []
    from lightning_dist.callbacks import Timeline

    return [Timeline(a.timeline_out)]


def _timed_loop(
    module: Any, forward: Any, optimizer: Any, rank: int, world: int, a: argparse.Namespace
) -> dict[str, Any]:
    import time as _time

    from torch.utils.data import DataLoader, DistributedSampler

    data = module.train_dataloader().dataset
    loader = DataLoader(
        data,
        batch_size=module.per_rank_batch,
        # as Lightning's injected sampler: shuffled (for training, whatever the loader says), seeded by
        # PL_GLOBAL_SEED, which seed_everything(1234) sets
        sampler=DistributedSampler(data, world, rank, shuffle=True, seed=1234),
        drop_last=True,
    )
    times: list[float] = []
    marks: list[int] = []
    total = a.warmup + a.steps
    module.train()
    for i, batch in enumerate(loader):
        if i == total:
            break
        if i == a.warmup:
            marks.append(_tx_bytes())
        start = _time.perf_counter()
        optimizer.zero_grad()
        module.loss_of(forward, batch).backward()
        optimizer.step()
        times.append(_time.perf_counter() - start)
    marks.append(_tx_bytes())
    if len(times) < total:
        raise RuntimeError(f"the data ran out after {len(times)} of {total} steps")
    return {
        "rank": rank,
        "world_size": world,
        "step_seconds": times[a.warmup :],
        "counted_bytes": None,
        "wire_bytes": (marks[1] - marks[0]) / a.steps,
    }


def run_torch(row: Row, a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(1234)
    rank = int(os.environ["NODE_RANK"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    try:
        module = build_model(a.model, row)
        hook = row.options.get("hook")
        # torch's PowerSGD hook fails on Gloo with more than one bucket (FACTS.md): one bucket
        ddp = DistributedDataParallel(module, bucket_cap_mb=1000 if hook == "powersgd" else None)
        if hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        result = _timed_loop(module, ddp, module.configure_optimizers(), rank, 2, a)
        if rank == 0:
            result["loss"] = _eval_loss(module)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


def run_hvd_loop(row: Row, a: argparse.Namespace) -> dict[str, Any]:
    import horovod.torch as hvd
    import torch

    hvd.init()
    try:
        torch.manual_seed(1234)
        module = build_model(a.model, row)
        optimizer = module.configure_optimizers()
        op = row.options["op"]
        factor = hvd.local_size() if op == "adasum" else hvd.size()  # Horovod's lr rule, as Horovod()'s
        for group in optimizer.param_groups:
            group["lr"] *= factor
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=module.named_parameters(),
            compression=hvd.Compression.fp16 if op == "fp16" else hvd.Compression.none,
            op=hvd.Adasum if op == "adasum" else hvd.Average,
        )
        result = _timed_loop(module, module, optimizer, hvd.rank(), hvd.size(), a)
        if hvd.rank() == 0:
            result["loss"] = _eval_loss(module)
    finally:
        hvd.shutdown()
    return result


def worker(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    row = ROWS[a.worker]
    run = {"lightning": run_lightning, "torch": run_torch, "hvd_loop": run_hvd_loop}[row.kind]
    result = run(row, a)
    if result["rank"] == 0 and a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(result, fh)


# -- the driver: clusters, rounds, table, plot -------------------------------------------------------


def row_unavailable(row: Row) -> Optional[str]:
    """Why ``row`` cannot run here (None: it can)."""
    if row.mpirun or row.kind == "hvd_loop":
        if shutil.which("mpirun") is None:
            return "mpirun not found (apt-get install openmpi-bin)"
        try:
            import horovod.torch  # noqa: F401
        except ImportError as exc:
            return f"horovod not importable ({exc}): lightning-dist install-horovod"
    return None


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), str(BENCH_DIR), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait(timeout=10)


def launch(
    cluster: Any,
    row: Row,
    model: str,
    a: argparse.Namespace,
    out: str,
    port: int,
    trace: Optional[str] = None,
) -> dict[str, Any]:
    """One run of ``row`` on ``model`` across the cluster's 2 nodes; rank 0's result or {'error': ...}.
    ``trace``: where a pack row writes its Timeline (an mpirun row also Horovod's, beside it)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", row.key, "--model", model,
            "--steps", str(a.steps), "--warmup", str(a.warmup), "--json-out", out]  # fmt: skip
    if trace and row.ours:
        argv += ["--timeline-out", trace]
    timeout = a.timeout or 120 + 30 * (a.steps + a.warmup)
    cluster.master_port = port  # a fresh rendezvous port per run: no TIME_WAIT leftovers of the last one
    env = _env()
    if os.path.exists(out):
        os.remove(out)
    if row.mpirun:
        mpirun = ["mpirun", "-np", "2", *cluster.mpirun_args(), "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                  "-x", "PYTHONUNBUFFERED"]  # fmt: skip
        if trace:
            mpirun += ["-x", f"HOROVOD_TIMELINE={horovod_timeline_path(trace)}"]
        mpirun += argv
        with tempfile.TemporaryFile() as log:
            proc = cluster.popen(0, mpirun, env, stdout=log, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = 124
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
    else:
        try:
            results = cluster.run_each(argv, timeout=timeout, env=env)
            code = max(abs(r.returncode) for r in results)
            tail = "\n".join(f"--- node {i} ---\n{r.stderr[-1500:]}" for i, r in enumerate(results))
        except TimeoutError as err:
            code, tail = 124, str(err)[-3000:]
    if code != 0 or not os.path.exists(out):
        return {"error": f"exit {code}\n{tail}"}
    with open(out) as fh:
        return json.load(fh)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _quantiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures of one (model, cap, row) over its rounds; 'error' if no round succeeded."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run", "failed": len(runs)}
    steps = [t for r in ok for t in r["step_seconds"]]
    counted = [r["counted_bytes"] for r in ok if r.get("counted_bytes") is not None]
    wire = [r["wire_bytes"] for r in ok if r.get("wire_bytes") is not None]
    losses = [r["loss"] for r in ok if r.get("loss") is not None]
    p25, p75 = _quantiles(steps)
    return {
        "median_s": _median(steps),
        "p25_s": p25,
        "p75_s": p75,
        "round_medians_s": [_median(r["step_seconds"]) for r in ok],
        "counted_bytes": _median(counted) if counted else None,
        "wire_bytes": _median(wire) if wire else None,
        "loss": _median(losses) if losses else None,
        "rounds": len(ok),
        "failed": len(runs) - len(ok),
    }


def link_limit_s(nbytes: Optional[float], cap_mbit: Optional[float]) -> Optional[float]:
    if nbytes is None or cap_mbit is None:
        return None
    return nbytes * 8 / (cap_mbit * 1e6)


def _ms(s: Optional[float]) -> str:
    return "-" if s is None or math.isnan(s) else f"{s * 1e3:.1f}"


def _bytes(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e6:.3f} MB"


def format_tables(
    summary: dict[str, dict[str, dict[str, dict[str, Any]]]],
    models: Sequence[str],
    caps: Sequence[Optional[float]],
    rows: Sequence[str],
) -> str:
    """Markdown: per model a step-time grid (rows x caps, ratio to torch DDP) and the detailed table.

    ``summary[model][cap_label][row_key]`` is what ``summarize`` returns (or a {'skipped': why})."""
    out: list[str] = []
    for model in models:
        out.append(f"### {MODELS[model]}\n")
        head = "| row | " + " | ".join(cap_label(c) for c in caps) + " |"
        out += [head, "|---|" + "---:|" * len(caps)]
        for key in rows:
            cells = []
            for cap in caps:
                s = summary.get(model, {}).get(cap_label(cap), {}).get(key, {"error": "not run"})
                ref = summary.get(model, {}).get(cap_label(cap), {}).get(REFERENCE, {})
                if "median_s" not in s:
                    cells.append("skipped" if "skipped" in s else "failed")
                    continue
                ratio = f" ({s['median_s'] / ref['median_s']:.2f}x)" if "median_s" in ref else ""
                cells.append(f"{_ms(s['median_s'])} ms{ratio}")
            out.append(f"| {ROWS[key].label} | " + " | ".join(cells) + " |")
        out.append("")
        out += [
            "| row | cap | median step | IQR | vs torch DDP | counted bytes/step | wire bytes/step "
            "| link limit | loss |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for cap in caps:
            for key in rows:
                s = summary.get(model, {}).get(cap_label(cap), {}).get(key, {"error": "not run"})
                ref = summary.get(model, {}).get(cap_label(cap), {}).get(REFERENCE, {})
                if "median_s" not in s:
                    why = s.get("skipped") or f"failed ({s.get('failed', 0)} run(s))"
                    out.append(f"| {ROWS[key].label} | {cap_label(cap)} | {why} | | | | | | |")
                    continue
                ratio = f"{s['median_s'] / ref['median_s']:.2f}x" if "median_s" in ref else "-"
                limit = link_limit_s(s["wire_bytes"], cap)
                loss = "-" if s["loss"] is None else f"{s['loss']:.4f}"
                out.append(
                    f"| {ROWS[key].label} | {cap_label(cap)} | {_ms(s['median_s'])} ms "
                    f"| {_ms(s['p25_s'])}-{_ms(s['p75_s'])} | {ratio} | {_bytes(s['counted_bytes'])} "
                    f"| {_bytes(s['wire_bytes'])} | {_ms(limit)}{'' if limit is None else ' ms'} | {loss} |"
                )
        out.append("")
    return "\n".join(out)


NOTES = (
    "Step time: median over every timed step of every round (rank 0's clock; the ranks step together), "
    "IQR = 25th-75th percentile of the same steps. vs torch DDP: ratio to raw torch DDP (Gloo, no hook) "
    "at the same cap. counted bytes/step: rank 0's bytes through lightning_dist.collectives (pack "
    "strategies only; payload, every op of the step). wire bytes/step: rank 0's veth tx bytes over the "
    "timed steps / steps (/proc/net/dev in its namespace; Ethernet+IP+TCP headers and control traffic "
    "included; every row). link limit: wire bytes/step x 8 / cap, the time tbf needs to pass them "
    "(each direction is capped separately). loss: mean loss on a fixed evaluation set after "
    "(warmup + steps) x batch x 2 samples, median over rounds."
)


def horovod_timeline_path(trace: str) -> str:
    """Where an mpirun run whose Timeline goes to ``trace`` writes Horovod's own timeline."""
    return str(Path(trace).with_suffix(".horovod.json"))


HIGHLIGHT = ("ld_ddp", "ddp", "c_int8", "c_powersgd", "torch_powersgd", "horovod_adasum", "hvd_loop_adasum")
"""The rows the plot draws (every row is in the tables): the pack's DDP and Lightning's, two compressors
with torch's PowerSGD hook, and Adasum with Horovod's own loop."""


def plot(summary: dict[str, Any], models: Sequence[str], caps: Sequence[Optional[float]],
         rows: Sequence[str], path: Path, machine: str = "") -> Optional[str]:  # fmt: skip
    """One panel per model: each highlighted row's median step over torch DDP's at the same cap
    (below 1: faster), against the cap; ``machine`` goes in the title. None, or why no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib not importable ({exc})"
    if not any(v.get("median_s", 0) > 0 for m in summary.values() for c in m.values() for v in c.values()):
        return "no plot: no run measured a step time (every run failed or was skipped)"
    shown = [k for k in HIGHLIGHT if k in rows and k != REFERENCE] or [k for k in rows if k != REFERENCE]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.2), squeeze=False)
    xs = list(range(len(caps)))
    for ax, model in zip(axes[0], models):
        by_cap = [summary.get(model, {}).get(cap_label(c), {}) for c in caps]
        ref = [c.get(REFERENCE, {}).get("median_s", float("nan")) for c in by_cap]
        for i, key in enumerate(shown):
            ys = [c.get(key, {}).get("median_s", float("nan")) / r if r else float("nan")
                  for c, r in zip(by_cap, ref)]  # fmt: skip
            ax.plot(xs, ys, "-" if ROWS[key].ours else "--", marker="o", color=f"C{i}",
                    linewidth=2.2 if ROWS[key].ours else 1.4, label=ROWS[key].label)  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=1, label=f"{ROWS[REFERENCE].label} = 1")
        ax.set_xticks(xs, [cap_label(c) for c in caps])
        ax.set_yscale("log")
        ax.set_xlabel("link cap per direction")
        ax.set_ylabel("median step / torch DDP's (log; below 1 = faster)")
        ax.set_title(MODELS[model], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    title = "Step time across 2 emulated nodes, relative to torch DDP at the same link cap"
    fig.suptitle(f"{title}\n{machine}" if machine else title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * math.ceil((len(shown) + 1) / 4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def machine_caption(header: Sequence[str]) -> str:
    """The hardware, software and date of a results header, for a plot title."""
    from machine_info import plot_caption

    software = header[1].split(";")[0] if len(header) > 1 else ""
    date = next((h.removeprefix("date: ").split(";")[0] for h in header if h.startswith("date:")), "")
    return plot_caption(header[0] if header else "", software, date)


def replot(results: Path) -> Optional[str]:
    """Redraw ``results/cluster.png`` from ``results/cluster.json`` (no run)."""
    data = json.loads((results / "cluster.json").read_text())
    summary = data["summary"]
    models = [m for m in MODELS if m in summary]
    caps = [parse_cap(c.replace(" ", "").replace("/s", "")) for c in next(iter(summary.values()))]
    rows = [k for k in ROWS if any(k in c for m in summary.values() for c in m.values())]
    return plot(summary, models, caps, rows, results / "cluster.png", machine_caption(data["header"]))


def command_line(argv: Sequence[str]) -> str:
    return "python benchmarks/bench_cluster.py " + " ".join(argv)


def drive(a: argparse.Namespace, argv: Sequence[str]) -> int:
    from machine_info import machine

    from lightning_dist.cluster import netns

    reason = netns.unavailable_reason(rate_limited=any(c is not None for c in a.caps))
    if reason is not None:
        print(f"bench_cluster: cannot run: {reason}", file=sys.stderr)
        return 2
    rows = [ROWS[k] for k in a.rows]
    skipped = {r.key: why for r in rows if (why := row_unavailable(r)) is not None}
    for key, why in skipped.items():
        print(f"[bench_cluster] {ROWS[key].label}: skipped: {why}", flush=True)
    runnable = [r for r in rows if r.key not in skipped]
    if a.timeline:  # before the first run: Horovod opens its timeline file at hvd.init
        os.makedirs(a.timeline, exist_ok=True)
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    started, port = time.monotonic(), 29500
    total = len(a.caps) * a.rounds * len(a.models) * len(runnable)
    done = 0
    print(f"command: {command_line(argv)}\n{total} runs: {len(a.caps)} cap(s) x {a.rounds} round(s) x "
          f"{len(a.models)} model(s) x {len(runnable)} row(s)", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for cap in a.caps:
            with netns.EmulatedCluster(2, rate_mbit=cap) as cluster:
                for rnd in range(a.rounds):
                    for model in a.models:
                        shift = (rnd * 7 + a.models.index(model)) % max(1, len(runnable))
                        for row in runnable[shift:] + runnable[:shift]:
                            t0 = time.monotonic()
                            port = 29500 + (port - 29499) % 400
                            trace = None
                            if a.timeline:
                                name = f"{model}_{cap_label(cap).replace(' ', '').replace('/', '')}_{row.key}"
                                trace = os.path.join(a.timeline, f"{name}_round{rnd + 1}.json")
                            res = launch(cluster, row, model, a, os.path.join(tmp, "r.json"), port, trace)
                            runs.setdefault(model, {}).setdefault(cap_label(cap), {}).setdefault(row.key, [])
                            runs[model][cap_label(cap)][row.key].append(res)
                            done += 1
                            head = (f"[{done}/{total} {time.monotonic() - started:.0f}s] cap {cap_label(cap)} "
                                    f"round {rnd + 1}/{a.rounds} {model} {row.label}")  # fmt: skip
                            if "error" in res:
                                print(f"{head}: FAILED\n{res['error']}", flush=True)
                            else:
                                wire = res.get("wire_bytes")
                                print(f"{head}: median {_ms(_median(res['step_seconds']))} ms, "
                                      f"wire {_bytes(wire)}/step, run {time.monotonic() - t0:.0f}s", flush=True)  # fmt: skip
    summary: dict[str, Any] = {
        model: {
            cap_label(cap): {
                **{k: summarize(runs.get(model, {}).get(cap_label(cap), {}).get(k, [])) for k in a.rows},
                **{k: {"skipped": why} for k, why in skipped.items()},
            }
            for cap in a.caps
        }
        for model in a.models
    }
    import torch

    header = [
        f"machine: {machine()}",
        f"torch {torch.__version__}; 2 emulated nodes (network namespaces, veth, tc tbf per direction), "
        f"1 process x 1 thread per node; {a.rounds} round(s) x {a.steps} timed steps after {a.warmup} warm-up",
        f"command: {command_line(argv)}",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; took {time.monotonic() - started:.0f} s",
    ]
    text = "\n".join(["## Strategies across 2 emulated nodes", "", *[f"{h}  " for h in header], "",
                      format_tables(summary, a.models, a.caps, a.rows), NOTES, ""])  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.md").write_text(text)
    (out / "cluster.json").write_text(
        json.dumps({"header": header, "summary": summary, "runs": runs}, indent=1)
    )
    why_not = plot(summary, a.models, a.caps, a.rows, out / "cluster.png", machine_caption(header))
    print()
    print(text)
    print(
        f"wrote {out / 'cluster.md'}, {out / 'cluster.json'}"
        + (f"; {why_not}" if why_not else f", {out / 'cluster.png'}")
    )
    failed = any("error" in s for m in summary.values() for c in m.values() for s in c.values())
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.replot:
        why_not = replot(Path(a.out))
        print(why_not or f"wrote {Path(a.out) / 'cluster.png'}")
        return 0 if why_not is None else 1
    if a.worker is not None:
        worker(a)
        return 0
    return drive(a, argv)


if __name__ == "__main__":
    sys.exit(main())
