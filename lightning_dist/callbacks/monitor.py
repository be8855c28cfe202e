"""Per-step monitoring: step time, bytes on the wire, comm time and its share, compression ratio,
throughput and scaling efficiency, from the counters of the strategy's communicator
(``trainer.strategy.communicator.stats``: every strategy of the pack, Horovod's included, counts
there; a strategy without one, such as Lightning's own ``"ddp"``, reads as no communication, and on
more than one process CommMonitor warns once that it cannot see it)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from time import perf_counter
from typing import Any, Optional

import lightning as L
import torch
from typing_extensions import override

from lightning_dist.callbacks.stragglers import StragglerReport, gather_arrivals
from lightning_dist.compression.wire import ring_all_reduce_bytes
from lightning_dist.warn import warn_once


def _counters(trainer: L.Trainer) -> dict[str, float]:
    """The strategy's communicator's counters (``CommStats.snapshot``); {} for a strategy without one."""
    comm = getattr(trainer.strategy, "communicator", None)
    return {} if comm is None else comm.stats.snapshot()


STEP_SECONDS = "perf/step_seconds"
BYTES_SENT = "comm/bytes_sent"
BYTES_RECEIVED = "comm/bytes_received"
COMM_SECONDS = "comm/seconds"
COMM_SHARE = "comm/share"
COMPRESSION_RATIO = "comm/compression_ratio"
SAMPLES_PER_S = "perf/samples_per_s"
TOKENS_PER_S = "perf/tokens_per_s"
SCALING_EFFICIENCY = "perf/scaling_efficiency"
WAIT_SECONDS = "comm/wait_s"
STRAGGLER_RANK = "comm/straggler_rank"

METRICS = (
    STEP_SECONDS,
    BYTES_SENT,
    BYTES_RECEIVED,
    COMM_SECONDS,
    COMM_SHARE,
    COMPRESSION_RATIO,
    SAMPLES_PER_S,
    TOKENS_PER_S,
    SCALING_EFFICIENCY,
    WAIT_SECONDS,
    STRAGGLER_RANK,
)
"""Every key ``CommMonitor`` may log (throughput, scaling efficiency and the compression ratio only
where defined; the straggler keys only with ``stragglers=N``)."""

_SUMMARY_KEYS = {
    BYTES_RECEIVED: "bytes_received_per_step",
    COMM_SHARE: "comm_share",
    COMPRESSION_RATIO: "compression_ratio",
    SAMPLES_PER_S: "samples_per_s",
    TOKENS_PER_S: "tokens_per_s",
    SCALING_EFFICIENCY: "scaling_efficiency",
}


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    """The first tensor in ``batch`` (depth first through lists, tuples and mappings), or ``None``."""
    if isinstance(batch, torch.Tensor):
        return batch
    items: Iterable[Any] = ()
    if isinstance(batch, Mapping):
        items = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _is_token_ids(t: torch.Tensor) -> bool:
    return t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


class CommMonitor(L.Callback):
    """Measures every optimizer step of every strategy of the pack and logs it through
    ``pl_module.log`` (so any Lightning logger gets it; ``prog_bar`` picks the keys also shown in
    the progress bar and in ``trainer.progress_bar_metrics``).

    A *step* is one optimizer step (a batch after which ``trainer.global_step`` has advanced,
    with automatic or manual optimization): with gradient accumulation its micro-batches are added up (time
    from ``on_train_batch_start`` to ``on_train_batch_end`` of each, bytes and seconds counted in
    those windows); the values are logged on the batch that stepped, which is when Lightning sends
    step metrics to the loggers. Logged per step:

    - ``perf/step_seconds``: wall seconds of the step's batches (forward, backward, optimizer,
      collectives; data loading between batches is not in it);
    - ``comm/bytes_sent`` / ``comm/bytes_received``: bytes this rank sent / received through the
      collectives during the step (every op: gradients and e.g. a ``sync_dist`` loss);
    - ``comm/seconds``: wall seconds of the step during which at least one collective was in
      flight (posting to completion; collectives in flight together, such as Horovod's one
      all-reduce per gradient tensor, count once: ``CommStats.busy_seconds``);
    - ``comm/share``: ``comm/seconds / perf/step_seconds``, the share of the step with
      communication in flight, in [0, 1] (time it overlapped the backward pass included);
    - ``comm/compression_ratio``: ``comm/bytes_sent`` over the bytes a plain fp32 ring all-reduce of
      the gradients (the trainable parameters' elements) sends per rank,
      ``ring_all_reduce_bytes(4 * numel, world_size)``: about 1 for ``DDP()``, 0.5 for
      ``Compressed("fp16")``; absent at world size 1 (no reference bytes);
    - ``perf/samples_per_s``: global, ``samples x world_size / perf/step_seconds``, samples being the
      step's batch sizes (``batch_size=`` if given, else dim 0 of each batch's first tensor);
    - ``perf/tokens_per_s``: ``tokens x world_size / perf/step_seconds``, tokens being
      ``samples x tokens_per_sample=`` if given, else the element count of a batch whose first
      tensor is 2-D integer token ids; absent otherwise;
    - ``perf/scaling_efficiency``: ``perf/samples_per_s / (world_size x single_process_samples_per_s)``
      when ``single_process_samples_per_s=`` (one process's measured throughput) is given.

    The values are rank-local (this rank's counters and clock; the global rates assume every rank
    takes the same batch size) unless ``sync_dist=True``, which averages them over the ranks through
    Lightning (one scalar all-reduce per key and step, after the step's window: counted in no
    step, but in the collectives' totals). Each
    step's values are kept in ``history``; ``summary()`` gives medians over the steps after
    ``warmup``. ``losses`` holds the rank-local loss of every batch (micro-batch).

    ``stragglers=N`` (0, the default: off) adds the straggler report: every collective's arrival
    time is recorded on each rank (``Communicator.arrivals``), and every N optimizer steps (and at
    the end of training) the ranks gather them (one ``all_gather`` through the communicator, after
    the step's window: in no step's counters) and log, on the step that closes the interval:

    - ``comm/wait_s``: seconds per step this rank waited at collectives for the last rank to arrive
      (the sum over the interval's collectives of ``last arrival - this rank's arrival``, divided by
      the interval's steps);
    - ``comm/straggler_rank``: the rank that was last at the most of the interval's collectives.

    ``straggler_report`` (a ``StragglerReport``, every rank) holds the totals of the fit, and rank 0
    prints its table at the end of training ("rank 1 was last at 93% of 120 collectives, the others
    waited 41% of their step for it"). The clock is Unix time: see ``collectives.arrivals``.
    """

    def __init__(
        self,
        warmup: int = 3,
        log: bool = True,
        *,
        batch_size: Optional[int] = None,
        tokens_per_sample: Optional[int] = None,
        single_process_samples_per_s: Optional[float] = None,
        prog_bar: Iterable[str] = (SAMPLES_PER_S, COMM_SHARE),
        sync_dist: bool = False,
        stragglers: int = 0,
    ) -> None:
        if isinstance(stragglers, bool) or not isinstance(stragglers, int) or stragglers < 0:
            raise ValueError(
                f"stragglers={stragglers!r}: accepted an int >= 0 (every how many steps to report; 0: off)"
            )
        for name, value in (
            ("batch_size", batch_size),
            ("tokens_per_sample", tokens_per_sample),
            ("single_process_samples_per_s", single_process_samples_per_s),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 (or None)")
        prog_bar = tuple(prog_bar)
        unknown = [k for k in prog_bar if k not in METRICS]
        if unknown:
            raise ValueError(f"prog_bar={list(prog_bar)}: unknown keys {unknown}; accepted: {list(METRICS)}")
        self.warmup = warmup
        # not ``self.log``: Lightning sets every callback's ``log`` to the module's ``log`` at fit start
        self.log_metrics = log
        self.batch_size = batch_size
        self.tokens_per_sample = tokens_per_sample
        self.single_process_samples_per_s = single_process_samples_per_s
        self.prog_bar = frozenset(prog_bar)
        self.sync_dist = sync_dist
        self.stragglers = stragglers
        self.straggler_report: Optional[StragglerReport] = None
        self._interval_steps = 0
        # one entry per optimizer step
        self.history: list[dict[str, float]] = []
        self.step_seconds: list[float] = []
        self.bytes_sent: list[int] = []
        self.bytes_received: list[int] = []
        self.comm_seconds: list[float] = []
        self.samples: list[int] = []
        # one entry per batch
        self.losses: list[float] = []
        self.gradient_numel: Optional[int] = None
        self._start = 0.0
        self._base: dict[str, float] = {}
        self._step_before = 0
        self._pending = self._empty()
        self._warned_unmeasured = False

    @staticmethod
    def _empty() -> dict[str, float]:
        return {
            "seconds": 0.0,
            "sent": 0,
            "received": 0,
            "comm": 0.0,
            "samples": 0,
            "tokens": 0,
            "batches": 0,
        }

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.gradient_numel = self._trainable_numel(pl_module)
        self._pending = self._empty()
        comm = getattr(trainer.strategy, "communicator", None)
        if trainer.world_size > 1 and comm is None:
            self._warn_unmeasured(trainer)
        self.straggler_report = None
        self._interval_steps = 0
        if self.stragglers and comm is not None and comm.world_size > 1:
            self.straggler_report = StragglerReport(comm.world_size)
            comm.arrivals.start()

    def _warn_unmeasured(self, trainer: L.Trainer) -> None:
        """Once per monitor: this strategy's collectives are not counted, so comm/* read 0."""
        if self._warned_unmeasured:
            return
        self._warned_unmeasured = True
        name = type(trainer.strategy).__name__
        warn_once(
            f"CommMonitor: {name} does not count its communication, so {BYTES_SENT}, {BYTES_RECEIVED}, "
            f"{COMM_SECONDS}, {COMM_SHARE} and {COMPRESSION_RATIO} read 0 under it; CommMonitor measures the "
            "collectives of lightning_dist's strategies (listed by `lightning-dist strategies`; for Lightning's "
            'strategy="ddp" use strategy="ld_ddp" or lightning_dist.DDP(), the same training). Step time and '
            "throughput are measured under any strategy",
            stacklevel=3,
        )

    @staticmethod
    def _trainable_numel(pl_module: L.LightningModule) -> int:
        return sum(p.numel() for p in pl_module.parameters() if p.requires_grad)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step
        self._base = _counters(trainer)
        self._start = perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        elapsed = perf_counter() - self._start
        now = _counters(trainer)
        pending = self._pending
        pending["seconds"] += elapsed
        pending["sent"] += int(now.get("bytes_sent", 0) - self._base.get("bytes_sent", 0))
        pending["received"] += int(now.get("bytes_received", 0) - self._base.get("bytes_received", 0))
        pending["comm"] += now.get("busy_seconds", 0.0) - self._base.get("busy_seconds", 0.0)
        samples, tokens = self._count(batch)
        pending["samples"] += samples
        pending["tokens"] += tokens
        pending["batches"] += 1
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach()))
        if trainer.global_step == self._step_before:
            return  # accumulating: the optimizer has not stepped yet
        self._pending = self._empty()
        metrics = self._step_metrics(pending, trainer.world_size, pl_module)
        self.history.append(metrics)
        self.step_seconds.append(metrics[STEP_SECONDS])
        self.bytes_sent.append(int(metrics[BYTES_SENT]))
        self.bytes_received.append(int(metrics[BYTES_RECEIVED]))
        self.comm_seconds.append(metrics[COMM_SECONDS])
        self.samples.append(int(pending["samples"]))
        if self.log_metrics:
            for key, value in metrics.items():
                pl_module.log(
                    key,
                    value,
                    on_step=True,
                    on_epoch=False,
                    prog_bar=key in self.prog_bar,
                    sync_dist=self.sync_dist,
                    batch_size=1,
                )
        if self.straggler_report is not None:
            self._interval_steps += 1
            if self._interval_steps >= self.stragglers:
                self._report_interval(trainer, pl_module)

    def _gather_interval(self, trainer: L.Trainer, step_seconds: Optional[float] = None) -> StragglerReport:
        """The interval's report (every rank's arrivals since the last one), added to the fit's."""
        report = self.straggler_report
        assert report is not None
        comm = trainer.strategy.communicator  # type: ignore[attr-defined]
        matrix, steps = gather_arrivals(comm, comm.arrivals.take(), step_seconds)
        interval = StragglerReport(report.world_size)
        for starts in matrix:
            interval.add(starts)
        report.merge(interval)
        if steps is not None:
            report.step_seconds = steps
        return interval

    def _report_interval(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        interval = self._gather_interval(trainer)
        steps, self._interval_steps = self._interval_steps, 0
        values = {WAIT_SECONDS: interval.wait_s(trainer.global_rank) / max(1, steps)}
        straggler = interval.straggler()
        if straggler is not None:
            values[STRAGGLER_RANK] = float(straggler)
        if self.history:
            self.history[-1].update(values)
        if self.log_metrics:
            for key, value in values.items():  # rank-local already global: never averaged
                pl_module.log(
                    key, value, on_step=True, on_epoch=False, prog_bar=key in self.prog_bar, batch_size=1
                )

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.straggler_report is None:
            return
        self._gather_interval(trainer, sum(self.step_seconds))
        trainer.strategy.communicator.arrivals.stop()  # type: ignore[attr-defined]
        if trainer.global_rank == 0:
            print(f"Straggler report ({trainer.world_size} ranks)\n{self.straggler_report.table()}")

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        comm = getattr(trainer.strategy, "communicator", None)
        if comm is not None:
            comm.arrivals.stop()

    def _count(self, batch: Any) -> tuple[int, int]:
        """(samples, tokens) in one batch on this rank; tokens 0 where unknown."""
        first = _first_tensor(batch)
        if self.batch_size is not None:
            samples = self.batch_size
        elif first is not None and first.dim() > 0:
            samples = int(first.shape[0])
        else:
            samples = 0
        if self.tokens_per_sample is not None:
            tokens = samples * self.tokens_per_sample
        elif first is not None and _is_token_ids(first):
            tokens = first.numel()
        else:
            tokens = 0
        return samples, tokens

    def _step_metrics(
        self, pending: dict[str, float], world_size: int, pl_module: L.LightningModule
    ) -> dict[str, float]:
        seconds = pending["seconds"]
        out = {
            STEP_SECONDS: seconds,
            BYTES_SENT: float(pending["sent"]),
            BYTES_RECEIVED: float(pending["received"]),
            COMM_SECONDS: pending["comm"],
            COMM_SHARE: pending["comm"] / seconds if seconds > 0 else 0.0,
        }
        if self.gradient_numel is None:
            self.gradient_numel = self._trainable_numel(pl_module)
        reference = ring_all_reduce_bytes(4 * self.gradient_numel, world_size)
        if reference > 0:
            out[COMPRESSION_RATIO] = pending["sent"] / reference
        if seconds > 0 and pending["samples"] > 0:
            out[SAMPLES_PER_S] = pending["samples"] * world_size / seconds
            if pending["tokens"] > 0:
                out[TOKENS_PER_S] = pending["tokens"] * world_size / seconds
            if self.single_process_samples_per_s is not None:
                out[SCALING_EFFICIENCY] = out[SAMPLES_PER_S] / (
                    world_size * self.single_process_samples_per_s
                )
        return out

    def summary(self) -> dict[str, float]:
        """Medians over the steps after ``warmup`` (all steps if there are no more): ``steps``,
        ``median_step_s``, ``bytes_sent_per_step``, ``bytes_received_per_step``, ``comm_s_per_step``,
        ``comm_share`` and, where logged, ``compression_ratio``, ``samples_per_s``, ``tokens_per_s``,
        ``scaling_efficiency``."""
        rows = self.history[self.warmup :] or self.history

        def median(key: str, empty: float) -> float:
            values = [r[key] for r in rows if key in r]
            return statistics.median(values) if values else empty

        out: dict[str, float] = {
            "steps": len(self.history),
            "median_step_s": median(STEP_SECONDS, math.nan),
            "bytes_sent_per_step": median(BYTES_SENT, 0.0),
            "comm_s_per_step": median(COMM_SECONDS, 0.0),
        }
        for key, name in _SUMMARY_KEYS.items():
            if any(key in r for r in rows) or key in (BYTES_RECEIVED, COMM_SHARE):
                out[name] = median(key, 0.0)
        return out
