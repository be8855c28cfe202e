"""Train the embedded workload with any strategy; shared by examples, the demo and benchmarks."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import lightning as L
import torch

from lightning_dist import collectives
from lightning_dist.callbacks import CommMonitor
from lightning_dist.workload.model import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


@dataclass
class TrainRun:
    """One training run of the workload."""

    strategy: str = "ld_ddp"
    """A registered strategy name (Lightning's or lightning_dist's), or 'module:Class'."""
    devices: int = 2
    accelerator: str = "cpu"
    num_nodes: int = 1
    max_steps: int = 60
    accumulate_grad_batches: int = 1
    precision: str = "32-true"
    seed: int = 1234
    val_batches: int = 8
    threads_per_rank: int = 1
    workload: dict[str, Any] = field(default_factory=dict)
    """Overrides for ``WorkloadConfig`` fields."""


def build_strategy(spec: str) -> Any:
    """A registered name stays a string; ``module:Class`` or ``module:Class(kw=literal, ...)`` is built.

    Keyword values must be Python literals (numbers, strings, booleans, None, lists, dicts): nothing
    from the command line is evaluated as code.
    """
    import lightning_dist  # noqa: F401  (registers lightning_dist's strategy names)

    if ":" not in spec:
        from lightning.pytorch.strategies import StrategyRegistry

        from lightning_dist.strategies.registry import check_name

        check_name(
            StrategyRegistry, spec
        )  # an unknown ld_ name: its closest names, `lightning-dist strategies`
        return spec
    module_name, _, expr = spec.partition(":")
    try:
        call = ast.parse(expr if "(" in expr else expr + "()", mode="eval").body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            raise ValueError("not a call with keyword arguments")
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
        if len(kwargs) != len(call.keywords):
            raise ValueError("**kwargs are not accepted")
    except (SyntaxError, ValueError) as exc:
        raise ValueError(
            f"--strategy {spec!r}: {exc}; accepted: a registered name, 'module:Class' or "
            "'module:Class(keyword=literal, ...)'"
        ) from None
    from lightning.pytorch.strategies import Strategy

    cls = getattr(importlib.import_module(module_name), call.func.id, None)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(
            f"--strategy {spec!r}: {module_name}.{call.func.id} is not a Lightning Strategy class"
        )
    return cls(**kwargs)


def train(run: TrainRun) -> dict[str, Any]:
    """Fit, validate and return a summary (loss, step time, bytes) from this rank."""
    torch.set_num_threads(run.threads_per_rank)
    L.seed_everything(run.seed, workers=True, verbose=False)
    model = TinyCausalLM(WorkloadConfig(seed=run.seed, **run.workload))
    monitor = CommMonitor(log=False)
    trainer = quiet_trainer(
        accelerator=run.accelerator,
        devices=run.devices,
        num_nodes=run.num_nodes,
        strategy=build_strategy(run.strategy),
        max_steps=run.max_steps,
        accumulate_grad_batches=run.accumulate_grad_batches,
        precision=run.precision,  # type: ignore[arg-type]
        limit_val_batches=run.val_batches,
        val_check_interval=None,
        check_val_every_n_epoch=None if run.max_steps > 0 else 1,
        callbacks=[monitor],
        # bitwise-repeatable on CPU; on GPUs some kernels have no deterministic variant
        deterministic=run.accelerator == "cpu",
    )
    trainer.fit(model)
    train_loss = float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan"))))
    metrics = trainer.validate(model, verbose=False)[0]
    summary = monitor.summary()
    return {
        "strategy": run.strategy,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "final_val_loss": float(metrics["val_loss"]),
        "final_train_loss": train_loss,
        **summary,
        "step_seconds": monitor.step_seconds[monitor.warmup :],
    }


def build_parser() -> argparse.ArgumentParser:
    """The example's flags, each with its help and default (``--help``)."""
    parser = argparse.ArgumentParser(
        description="Train the embedded workload (stdlib byte LM).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = TrainRun()
    add = parser.add_argument
    add("--strategy", default=defaults.strategy, help="a registered name, or module:Expression(...)")
    add(
        "--devices",
        default="auto",
        help="per node; auto: every GPU when there are GPUs, else 2 CPU processes",
    )
    add("--accelerator", default="auto", help="cpu, gpu, or auto (gpu when there are GPUs)")
    add("--num-nodes", type=int, default=defaults.num_nodes, help="nodes (one launcher per node)")
    add("--max-steps", type=int, default=defaults.max_steps, help="optimizer steps")
    add("--accumulate", type=int, default=defaults.accumulate_grad_batches, help="batches per optimizer step")
    add("--precision", default=defaults.precision, help="Lightning precision, e.g. bf16-mixed on GPUs")
    add("--seed", type=int, default=defaults.seed, help="seed of weights and data order")
    add(
        "--threads-per-rank",
        type=int,
        default=defaults.threads_per_rank,
        help="torch CPU threads per process",
    )
    add("--workload", default="{}", help="JSON overrides for WorkloadConfig")
    add("--json-out", default=None, help="rank 0 writes its summary here")
    return parser


def resolve_devices(accelerator: str, devices: str) -> tuple[str, Union[int, str]]:
    """``auto`` made concrete: the GPUs when there are any (every one of them), else 2 CPU processes."""
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if devices == "auto":
        return accelerator, (-1 if accelerator == "gpu" else TrainRun().devices)
    return accelerator, int(devices)


def parse_args(argv: Optional[list[str]] = None) -> tuple[TrainRun, Optional[str]]:
    a = build_parser().parse_args(argv)
    accelerator, devices = resolve_devices(a.accelerator, a.devices)
    run = TrainRun(
        strategy=a.strategy,
        devices=devices,  # type: ignore[arg-type]
        accelerator=accelerator,
        num_nodes=a.num_nodes,
        max_steps=a.max_steps,
        accumulate_grad_batches=a.accumulate,
        precision=a.precision,
        seed=a.seed,
        threads_per_rank=a.threads_per_rank,
        workload=json.loads(a.workload),
    )
    return run, a.json_out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    run, json_out = parse_args(argv)
    result = train(run)
    collectives.shutdown()
    if result["rank"] == 0:
        print(json.dumps(result))
        if json_out:
            with open(json_out, "w") as fh:
                json.dump({"run": asdict(run), "result": result}, fh)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
