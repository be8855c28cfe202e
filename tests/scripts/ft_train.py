"""One replica group of a FaultTolerant run (under torchrun, started by tests/test_fault_tolerant.py).

Environment: FT_OUT (a directory), FT_STEPS (max_steps), FT_GROUPS (replica groups, default 2),
FT_FAIL (``group:step[:rank][,...]``: that group's worker (its process ``rank``, default 0) SIGKILLs itself at
its first batch of that step, on its first attempt only: torchft's ``fail_at(rank, step)``), FT_SLEEP and FT_AWAIT (a group training without all FT_GROUPS groups sleeps
FT_SLEEP per slot until the restart FT_AWAIT names has rejoined),
FT_TIMEOUT (the strategy's timeout_s), FT_RESTART_PAUSE (seconds a restarted worker waits first),
FT_RESTART_AFTER (a group whose step without all groups a restarted worker waits for first),
FT_KILL_IN_RECOVERY (a group whose first restart SIGKILLs
itself while it applies its peer's state), FT_COMMITS (the commits' directory), FT_COMPRESSOR and
FT_COMPRESSOR_OPTIONS (``FaultTolerant(compressor=..., **options)``, the options as JSON), FT_REDUCE_OP
(``FaultTolerant(reduce_op=...)``),
FT_DROP_RESIDUAL (``group:step``: that group's error-feedback residuals are zeroed at that step's
start, what a group killed there loses), FT_INNER=sgd (plain SGD instead of Adam), FT_STRATEGY=diloco
(``FaultTolerantDiLoCo``, FT_H inner steps, FT_REJOIN_TIMEOUT, FT_DILOCO_COMPRESSION; it also writes
``syncs_<g>.jsonl``: the checksum of each sync's state, and ``starts_<g>.jsonl``: each period started
from a loaded state, its sync and the checksum of what was loaded).
Every batch's hooks are checked as a user's would read them (``Hooks``: the real batch, the
``training_step`` that ran on it and its outputs); a mismatch raises in the worker.
Writes, per group (per process ``<g>.<rank>`` for the group's ranks > 0, under ``--nproc-per-node`` > 1):
``pids_<g>.txt`` (one line per attempt),
``steps_<g>.jsonl`` (each committed step, its samples and quorum size, flushed before the next
step), ``hooks_<g>_<attempt>.json`` (the batches the hooks and ``training_step`` saw, at the end),
``final_<g>.pt`` (the weights at the end) and, with a compressor, ``handoffs_<g>_<attempt>.pt``
(the compressor state it sent to or received from a peer, ``Handoff`` as dicts).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import FaultTolerant, FaultTolerantDiLoCo
from lightning_dist.collectives.fault_tolerant import state_checksum
from lightning_dist.wire.fault_tolerant_compression import without_residuals

OUT = Path(os.environ["FT_OUT"])
GROUP = int(os.environ["REPLICA_GROUP_ID"])
GROUPS = int(os.environ.get("FT_GROUPS", "2"))
RANK = int(os.environ.get("RANK", "0"))
NAME = str(GROUP) if RANK == 0 else f"{GROUP}.{RANK}"
"""This process's file names: its group's, and its rank in the group beyond rank 0."""
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAIL = {(*map(int, item.split(":")), 0)[:3] for item in os.environ.get("FT_FAIL", "").split(",") if item}
SLEEP = float(os.environ.get("FT_SLEEP", "0"))
PAUSE = float(os.environ.get("FT_PAUSE", "0"))
"""Seconds every owned slot takes longer (a slower step, for tests that act during the run)."""
DROP = os.environ.get("FT_DROP_RESIDUAL", "")
AWAIT = os.environ.get("FT_AWAIT", "")
"""``group:attempt``: a group training without all groups sleeps FT_SLEEP per slot until that attempt has rejoined."""
AWAIT_START = os.environ.get("FT_AWAIT_START", "")
"""``group:attempt``: before that sleep, wait (at most 100 s) until that attempt's process has started,
so a group cannot end before a slow restart is back however loaded the machine (only where nothing
the restart needs from this group comes before its start)."""


def awaited() -> bool:
    """Whether the rejoin FT_AWAIT names has not happened yet."""
    if not AWAIT:
        return False
    group, attempt = AWAIT.split(":")
    return not (OUT / f"rejoined_{group}_{attempt}").exists()


def wait_for_a_step_without(group: str) -> None:
    """Until ``group`` (a healthy group's id; "" none) has committed a step without all FT_GROUPS
    groups, at most 100 s: a restart that is back only after the others trained without it, however
    loaded the machine (FT_RESTART_AFTER)."""
    steps, deadline = OUT / f"steps_{group}.jsonl", time.monotonic() + 100
    while group and time.monotonic() < deadline:
        lines = steps.read_text().splitlines() if steps.exists() else []
        if any(line.endswith("}") and json.loads(line)["participants"] < GROUPS for line in lines):
            return
        time.sleep(0.1)


def wait_until_started() -> None:
    """Until the attempt FT_AWAIT_START names has written its PID (at most 100 s)."""
    if not AWAIT_START:
        return
    group, attempt = AWAIT_START.split(":")
    pids, deadline = OUT / f"pids_{group}.txt", time.monotonic() + 100
    while time.monotonic() < deadline:
        if pids.exists() and any(line.split()[0] == attempt for line in pids.read_text().splitlines()):
            return
        time.sleep(0.1)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.stepped: list[tuple[list[int], torch.Tensor]] = []
        """The samples and the loss of each ``training_step`` (``Hooks`` reads them)."""

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        time.sleep(PAUSE)
        if SLEEP and self.trainer.strategy.participants < GROUPS and awaited():  # type: ignore[attr-defined]
            wait_until_started()
            time.sleep(SLEEP)  # groups short of one slow down until the restarted one has rejoined
        loss = nn.functional.mse_loss(self.net(x), y)
        self.stepped.append((index.tolist(), loss.detach().clone()))
        return loss

    def configure_optimizers(self) -> dict:
        if os.environ.get("FT_INNER") == "sgd":  # no optimizer state: a redone period is bitwise the same
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        # a per-step schedule: a step that is not committed must not move it
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.97)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Hooks(L.Callback):
    """What a user's callback reads: each batch's hooks get the real batch (inputs, targets and
    sample ids) and ``on_train_batch_end`` the outputs of the ``training_step`` that ran on that very
    batch (its loss over the step's micro-batches, as Lightning's accumulation gives it); a hook
    without its ``training_step`` raises here. Counts written at the end (``hooks_<g>_<attempt>.json``)."""

    def __init__(self) -> None:
        self.started: list[list[int]] = []
        self.ended: list[list[int]] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx
    ) -> None:
        x, y, index = batch  # a user's hook unpacks the batch
        assert x.shape == (4, 8) and y.shape == (4, 1), (x.shape, y.shape)
        self.started.append(index.tolist())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx
    ) -> None:
        assert isinstance(pl_module, Regression)
        index = batch[2].tolist()
        assert pl_module.stepped, "on_train_batch_end without a training_step"
        trained, loss = pl_module.stepped[-1]
        assert trained == index == self.started[-1], (trained, index, self.started[-1:])
        assert len(pl_module.stepped) == len(self.started), "a batch's hooks fired without its training_step"
        slots = trainer.strategy.slots_per_step  # type: ignore[attr-defined]
        assert torch.equal(outputs["loss"], loss / slots), (outputs, loss, slots)
        self.ended.append(index)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(pl_module, Regression)
        seen = {"started": self.started, "ended": self.ended, "stepped": [i for i, _ in pl_module.stepped]}
        (OUT / f"hooks_{NAME}_{ATTEMPT}.json").write_text(json.dumps(seen))


class Record(L.Callback):
    """Fault injection at this process's first batch of a step, and each committed step on disk
    before the next one."""

    def __init__(self) -> None:
        self.written = 0
        self.last: int | None = None
        self.step: int | None = None
        self.synced = self.started = 0
        self.file = open(OUT / f"steps_{NAME}.jsonl", "a")  # noqa: SIM115

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx
    ) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, FaultTolerant)
        if isinstance(strategy, FaultTolerantDiLoCo):
            self.write_syncs(strategy)
        first, self.step = trainer.global_step != self.step, trainer.global_step
        if ATTEMPT == 0 and (GROUP, trainer.global_step, RANK) in FAIL and first:
            (OUT / f"killed_{NAME}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if f"{GROUP}:{trainer.global_step}" == DROP and first:
            assert strategy.compression is not None
            compressor = strategy.compression.compressor
            compressor.load_state_dict(without_residuals(compressor.state_dict()))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx
    ) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, FaultTolerant)
        for rec in strategy.committed[self.written :]:
            row = {
                "step": rec.step,
                "indices": rec.indices,
                "participants": rec.participants,
                "attempt": ATTEMPT,
                "t": time.time(),
            }
            self.file.write(json.dumps(row) + "\n")
        for rec in strategy.committed[self.written :]:
            # back with a peer after a restart, or after a gap in its steps (it was stopped)
            if rec.participants > 1 and (ATTEMPT or (self.last is not None and rec.step != self.last + 1)):
                (OUT / f"rejoined_{GROUP}_{ATTEMPT}").touch()
            self.last = rec.step
        self.written = len(strategy.committed)
        self.file.flush()
        os.fsync(self.file.fileno())

    def write_syncs(self, strategy: FaultTolerantDiLoCo) -> None:
        """Each new sync's state (once the strategy took it, before the next batch) and each period
        started from a loaded state, with their checksums."""
        if strategy.syncs != self.synced:
            self.synced = strategy.syncs
            row = {"sync": self.synced, "crc": state_checksum(strategy.sync_state()), "attempt": ATTEMPT}
            with open(OUT / f"syncs_{NAME}.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
        for sync, crc in strategy.starts[self.started :]:
            with open(OUT / f"starts_{NAME}.jsonl", "a") as fh:
                fh.write(json.dumps({"sync": sync, "crc": crc, "attempt": ATTEMPT}) + "\n")
        self.started = len(strategy.starts)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, FaultTolerantDiLoCo):
            self.write_syncs(trainer.strategy)


def main() -> None:
    with open(OUT / f"pids_{NAME}.txt", "a") as fh:
        fh.write(f"{ATTEMPT} {os.getpid()}\n")
    if ATTEMPT:  # a slower restart: the others train some steps without this group
        time.sleep(float(os.environ.get("FT_RESTART_PAUSE", "0")))
        wait_for_a_step_without(os.environ.get("FT_RESTART_AFTER", ""))
    n = 512
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = TensorDataset(x, y, torch.arange(n))
    compressor = os.environ.get("FT_COMPRESSOR") or None
    kind: Any = partial(
        FaultTolerant,
        compressor=compressor,
        reduce_op=os.environ.get("FT_REDUCE_OP", "avg"),
        **json.loads(os.environ.get("FT_COMPRESSOR_OPTIONS", "{}")),
    )
    if os.environ.get("FT_STRATEGY") == "diloco":
        rejoin = float(os.environ.get("FT_REJOIN_TIMEOUT", "60"))
        wire = os.environ.get("FT_DILOCO_COMPRESSION")
        kind = partial(
            FaultTolerantDiLoCo,
            inner_steps=int(os.environ["FT_H"]),
            rejoin_timeout_s=rejoin,
            compression=wire,
        )
    strategy = kind(
        replica_groups=GROUPS,
        global_batch=16,
        timeout_s=float(os.environ.get("FT_TIMEOUT", "10")),
        commit_every=int(os.environ.get("FT_COMMIT_EVERY", "10")),
        dirpath=os.environ.get("FT_COMMITS") or None,
    )
    if os.environ.get("FT_KILL_IN_RECOVERY") == str(GROUP) and ATTEMPT == 1:
        # the restarted worker dies again while it applies the state its peer sent
        strategy._load_state_dict = lambda state: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_steps=int(os.environ.get("FT_STEPS", "12")),
        default_root_dir=OUT,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(), Hooks()],
    )
    module = Regression()
    trainer.fit(module, DataLoader(data, batch_size=4))
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, OUT / f"final_{NAME}.pt")
    if strategy.compression is not None:
        handoffs = [asdict(h) for h in strategy.compression.handoffs]
        torch.save(handoffs, OUT / f"handoffs_{NAME}_{ATTEMPT}.pt")
    print(
        f"group {NAME} done at step {trainer.global_step}: {strategy.uncommitted_steps} uncommitted",
        flush=True,
    )


if __name__ == "__main__":
    main()
