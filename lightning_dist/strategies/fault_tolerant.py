"""``FaultTolerant``: live recovery on torchft. Replica groups train on; a failed one rejoins from a peer.

    python -m lightning_dist.launch.fault_tolerant --groups 2 -- train.py   # one box: Lighthouse + torchruns
    # train.py: L.Trainer(strategy=FaultTolerant(replica_groups=2), max_steps=1000)
    python -m lightning_dist.launch.fault_tolerant --groups 2 --nproc-per-group 4 -- train.py  # 4 per group
    lightning-dist slurm --nodes 4 --devices 8 --strategy ld_fault_tolerant -- python train.py  # a group a node

Each replica group is one torchrun (``--max-restarts``) of one or more processes; torchft's Lighthouse
forms a quorum of the live groups at every step, torchft's Manager reconfigures the Gloo (NCCL on
CUDA) group among them in place, and a (re)started group fetches weights, optimizer and scheduler
state from a healthy peer over torchft's checkpoint transport before its first forward pass. The
healthy groups' processes are never restarted; a step in flight when a group dies is not committed
and is run again by the quorum that follows.

Exactly-once data: the global batch of step s is a fixed set of ``global_batch`` samples
(``ElasticPlan``/``ElasticSampler`` of the pack's elastic data position, at world size 1: ``M``
micro-batches), whoever is alive. Lightning accumulates over ``M`` micro-batch slots per step; the
quorum's participants split the slots (slot j belongs to participant ``j % participants``), so when a
group is missing the others take its slots (more accumulation each), and a rejoining group reads
the slots of the step the quorum agreed on. The gradient is the sum over participants of their slots'
gradients (Lightning scales each micro-batch loss by ``1/M``): the mean over the step's samples,
the same with 2 groups or 1 up to the order of the float additions.

The training DataLoader must be map-style with ``batch_size`` (the micro-batch); the strategy reads
the samples of its slots itself (``dataset[i]`` and the loader's ``collate_fn``, in this process),
after the quorum. Lightning's loop sees only this process's micro-batches (``micro_batch_slots``):
each batch's hooks fire with its ``training_step``, its real batch and its outputs; Lightning steps
at every batch (``accumulate_grad_batches=1``) and the strategy sums a step's batches' gradients
and steps once, after the last. Lightning's epoch is the data epoch: it ends once the committed
steps reach the next one.

A replica group is ``G`` processes (``torchrun --nproc-per-node=G``, the same ``G`` in every group;
one node = one group with a process per device): the step's slots are split over every (group,
process) pair (slot j to ``j % (participants x G)``, process ``g`` of participant ``p`` being
``p x G + g``), the gradients are summed in the group and across the groups (a reduce-scatter in the
group, each process's shard across the groups with the same process of the others, an all-gather in
the group: ``FaultTolerantTransport.sum_over_groups``), the commit is voted by the group's processes
together, and a recovering process fetches the state of the same process of its peer group. Lightning
sees the group's processes as ranks ``0..G-1`` (rank 0 writes checkpoints and logs).

``compressor=`` sends the gradients through one of the pack's compressors (``Compressed``'s names
and objects); its state follows the groups across failures (``fault_tolerant_compression``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dist.algorithms.micro_batch_slots import (
    GradientSum,
    OwnBatches,
    scaled_loss,
    slots_per_process,
)
from lightning_dist.collectives import Communicator
from lightning_dist.collectives.fault_tolerant import (
    HOST_ENV,
    LIGHTHOUSE_ENV,
    REPLICA_GROUP_ENV,
    FaultTolerantTransport,
    require_torchft,
)
from lightning_dist.collectives.fault_tolerant_addresses import check_lighthouse, wait_for_lighthouse
from lightning_dist.collectives.fault_tolerant_logs import configure_torchft_logs, verbose_wanted
from lightning_dist.compat import disable_distributed_sampler, mark_last_batch, set_global_step
from lightning_dist.compression import Compressor
from lightning_dist.compression.packing import unflatten
from lightning_dist.elastic.commits import Commit, CommitStore
from lightning_dist.elastic.sampler import ElasticPlan, ElasticSampler
from lightning_dist.strategies.compressed import build_compressor
from lightning_dist.strategies.launch_needs import TORCHFT
from lightning_dist.strategies.names import register_class
from lightning_dist.strategies.options import FaultTolerantOptions, option_names, options_from
from lightning_dist.wire.fault_tolerant_compression import CompressedGradients

logger = logging.getLogger(__name__)
OWNER = "FaultTolerant"


def owns_slot(slot: int, participants: int, rank: Optional[int]) -> bool:
    """Whether the quorum's participant ``rank`` (None: not participating) computes ``slot``: slot j
    goes to participant ``j % participants``, so every slot of a step has exactly one owner."""
    return rank is not None and slot % participants == rank


def group_place() -> tuple[int, int]:
    """(processes of this replica group, this process's rank in it): torchrun's ``WORLD_SIZE`` and
    ``RANK`` (1 and 0 outside torchrun); ``ValueError`` when they do not make a rank of the group."""
    size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if size < 1 or not 0 <= rank < size:
        raise ValueError(
            f"{OWNER}: RANK={rank}, WORLD_SIZE={size}: a replica group's processes are ranks 0..G-1 of its "
            "own torchrun (--nproc-per-node=G); accepted: 0 <= RANK < WORLD_SIZE"
        )
    return size, rank


def resumed_message(step: int, path: object, dirpath: str, max_steps: int) -> str:
    """What a fit that starts from a commit says: which commit, and when ``max_steps`` is already
    reached (the fit then ends at once), how to start afresh."""
    message = f"{OWNER}: resumed from the commit of step {step} ({path})"
    if 0 <= max_steps <= step:
        message += (
            f"; Trainer(max_steps={max_steps}) is reached, nothing is left to train: to start afresh pass "
            f"another FaultTolerant(dirpath=...) or remove {dirpath}"
        )
    return message


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings without its parameters (what a scheduler may change)."""
    return {k: v for k, v in group.items() if k != "params"}


@dataclass
class StepRecord:
    """One committed step as this group saw it: the samples it trained on and the quorum's size."""

    step: int
    indices: list[int]
    participants: int


class _StepCallback(L.Callback):
    """After each batch (first of the callbacks, so the user's see it done): ``trainer.global_step``
    equal to the committed step, the schedulers Lightning stepped put back unless the step was
    committed at this batch, and the commits written (every ``commit_every`` steps and at the end
    of fit)."""

    def __init__(self, strategy: FaultTolerant) -> None:
        self.strategy = strategy

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = self.strategy
        if strategy.transport is None:
            return
        strategy.show_schedulers()
        set_global_step(trainer, strategy.data_step())
        strategy.undo_schedulers()
        every = strategy.options.commit_every
        if strategy.last_in_step and every and strategy.transport.step % every == 0:
            strategy.write_commit()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.strategy.write_commit()


class FaultTolerant(SingleDeviceStrategy):
    """One process of a replica group of a live-recovery job on torchft (module docstring): the
    group's only process (``--nproc-per-node=1``) or one of its ``G`` (``--nproc-per-node=G``, the
    same in every group; Lightning's ``global_rank`` is the rank in the group, ``world_size`` ``G``).

    Args:
        replica_groups: the groups the job is configured for; with ``global_batch`` unset, a step
            takes ``replica_groups`` x ``G`` x the DataLoader's ``batch_size`` samples.
        global_batch: samples per optimizer step over all groups (a multiple of the micro-batch).
        min_replica_size: the fewest groups that may commit a step (torchft's ``min_replica_size``).
        lighthouse: the Lighthouse address, ``http://host:port`` (default: ``$TORCHFT_LIGHTHOUSE``);
            a Lighthouse that does not answer within ``timeout_s`` fails the fit's setup, naming it.
        replica_id: this group's id, a str without ``:`` or an int (default: ``$REPLICA_GROUP_ID``,
            else torchft's random one).
        host: the address this group's servers listen on and advertise (checkpoint server, store);
            default ``$LD_FT_HOST`` or ``127.0.0.1``: set the node's address on a cluster.
        timeout_s: collectives, commits and checkpoint transfers (a group stopped longer is
            dropped from the quorum), and how long the Lighthouse may take to answer at setup.
        quorum_timeout_s: how long a quorum may take to form.
        quorum_retries: times a failed quorum request (the Lighthouse unreachable, restarting) is
            retried before the group fails (torchft's ``quorum_retries``).
        commit_every: committed steps between the pack's atomic commits (``CommitStore``, written by
            the quorum's participant 0's process 0, and at the end of fit); 0 writes none. A group that starts
            resumes from the newest one (``dirpath``), so a whole-job restart, or a group that finds
            no live peer, loses at most ``commit_every`` steps; with live peers it recovers from them.
        dirpath: where commits go (default ``<default_root_dir>/ft_commits``); shared by the groups. A
            fit that finds a commit there resumes from it and says so (rank 0): another ``dirpath``
            (or removing that one) starts afresh.
        keep: commits kept.
        start_groups: the groups the first step of a fresh start (not a torchrun restart) waits
            for (up to ``quorum_timeout_s``, then it starts with those there); default
            ``replica_groups``. A group that joins later fetches the state of the step it joins at
            from a peer.
        seed: seed of the per-epoch sample order (``ElasticSampler``).
        verbose: torchft's INFO logs (its Lighthouse's and Manager's, every quorum); default
            ``$LD_FT_VERBOSE`` (``1``: on), else off: warnings and errors only
            (``lightning_dist.collectives.fault_tolerant_logs``).
        device: this group's device (default: ``cuda:$LOCAL_RANK`` when CUDA is available, else CPU).
        compressor: None (the gradients summed in fp32), or a compressor as ``Compressed`` takes it:
            a name (``"fp16"``, ``"bf16"``, ``"int8"``, ``"powersgd"``, ``"topk"``, ...) or a
            ``lightning_dist.compression.Compressor`` instance. A recovering group receives the
            compressor's state from its peer with the rest; error-feedback residuals are split
            between them (``fault_tolerant_compression``).
        **compressor_options: the named compressor's options (``rank=2``).
    """

    strategy_name = "ld_fault_tolerant"
    launch_needs = TORCHFT
    checks_group_sizes = True
    """Whether each new quorum's first step checks that every group has as many processes as this
    one (a collective: every group of a quorum must make it at the same point of its step)."""

    def __init__(
        self,
        replica_groups: int = 2,
        global_batch: Optional[int] = None,
        min_replica_size: int = 1,
        lighthouse: Optional[str] = None,
        replica_id: Optional[Union[str, int]] = None,
        host: Optional[str] = None,
        timeout_s: float = 60.0,
        quorum_timeout_s: float = 60.0,
        quorum_retries: int = 3,
        seed: int = 0,
        commit_every: int = 50,
        dirpath: Optional[Union[str, os.PathLike[str]]] = None,
        keep: int = 3,
        start_groups: Optional[int] = None,
        verbose: Optional[bool] = None,
        device: Optional[Union[str, torch.device]] = None,
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        compressor: Optional[Union[str, Compressor]] = None,
        **compressor_options: Any,
    ) -> None:
        self.options = options_from(FaultTolerantOptions, locals())
        accepted = [*option_names(FaultTolerantOptions), "device", "compressor"]
        if compressor is None and compressor_options:
            raise ValueError(
                f"{OWNER} got unknown option(s) {', '.join(sorted(compressor_options))}; compressor options "
                f"need compressor= (a name or a Compressor); accepted: {', '.join(accepted)}"
            )
        self.compression: Optional[CompressedGradients] = None
        """The compressor and its state across failures (None: no compression)."""
        if compressor is not None:
            built = build_compressor(compressor, compressor_options, owner=OWNER, accepted=accepted)
            self.compression = CompressedGradients(built)
        self.verbose = verbose_wanted(self.options.verbose)
        """Whether torchft logs at INFO (``verbose``)."""
        configure_torchft_logs(self.verbose)  # before torchft's first import: its servers read RUST_LOG then
        require_torchft(OWNER)
        if device is None:
            cuda = torch.cuda.is_available()
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu"
        super().__init__(
            device=device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.store: Optional[CommitStore] = None
        self.resumed_from: Optional[int] = None
        """The step of the commit this group resumed from (None: none)."""
        self.transport: Optional[FaultTolerantTransport] = None
        self.plan: Optional[ElasticPlan] = None
        self._dataset: Any = None
        self._collate: Callable[[list[Any]], Any] = lambda samples: samples
        self._samplers: dict[int, ElasticSampler] = {}
        self._group_rank = 0
        """This process's rank in its replica group (``RANK`` under torchrun)."""
        self._group_size = 1
        """The replica group's processes (``WORLD_SIZE`` under torchrun)."""
        self._participants = 1
        self._rank: Optional[int] = None
        self._step_indices: list[int] = []
        self._queue: list[int] = []
        """The slots of the current step this process has still to train."""
        self.last_in_step = False
        """Whether the batch being trained is this process's last of its step (the step ends after it)."""
        self._step_epoch = 0
        """The data epoch of the current step."""
        self._gradients = GradientSum()
        self._hidden_schedulers: list[Any] = []
        self._trainer_devices: list[Any] = []
        self._skipping = False
        self._joined = False
        self._stepped = False
        """Whether the current step's optimizer step ran (it was committed)."""
        self._schedulers: list[dict[str, Any]] = []
        """The schedulers' states at the current step's start (restored when it is not committed)."""
        self._hyper: list[list[dict[str, Any]]] = []
        """The optimizers' param-group hyperparameters at the current step's start (likewise)."""
        self.committed: list[StepRecord] = []
        """Every step this group committed, with the samples it trained on (tests count them)."""
        self.uncommitted_steps = 0
        """Steps this group ran that were not committed (a peer failed during them)."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_class(strategy_registry, cls)

    # -- the transport ----------------------------------------------------------------------------
    @property
    def communicator(self) -> Optional[Communicator]:
        """The collectives over the quorum (``CommMonitor`` reads its counters)."""
        return None if self.transport is None else self.transport.communicator

    @property
    def parallel_devices(self) -> Optional[list[Any]]:
        """None: Lightning hands this strategy the devices of ``Trainer(devices=)`` (the setter), to
        check against the replica group's processes (``check_devices``)."""
        return None

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[Any]]) -> None:
        self._trainer_devices = list(devices or [])

    def check_devices(self, group_size: int) -> None:
        """``ValueError`` when ``Trainer(devices=N)`` asks for N > 1 devices and the replica group has
        another number of processes: each process trains on one device, and the launcher starts the
        group's processes (``--nproc-per-group N``). N equal to the group's processes is accepted
        (each takes the device of its ``LOCAL_RANK``), and so is ``devices="auto"`` on a GPU machine
        (every GPU: not a request for as many processes)."""
        n = len(self._trainer_devices)
        if n <= 1 or n == group_size:
            return
        accelerator = self.accelerator
        if (
            accelerator is not None
            and not isinstance(accelerator, CPUAccelerator)
            and n == accelerator.auto_device_count()
        ):
            return  # what devices="auto" gives on a GPU machine
        raise ValueError(
            f"{OWNER}: Trainer(devices={n}), but this replica group runs {group_size} process(es) "
            f"(WORLD_SIZE={group_size}): {OWNER} trains one device per process and its launcher starts "
            f"them; for {n} per group run python -m lightning_dist.launch.fault_tolerant --nproc-per-group "
            f"{n} (torchrun --nproc-per-node={n}); accepted: devices=1, 'auto' or {group_size}"
        )

    @override
    def setup_environment(self) -> None:
        self._group_size, self._group_rank = group_place()
        self.check_devices(self._group_size)
        # Lightning's ranks are the group's: only its rank 0 writes checkpoints and logs
        self.global_rank, self.world_size = self._group_rank, self._group_size
        rank_zero_only.rank = utils_rank_zero_only.rank = self._group_rank  # type: ignore[attr-defined]
        super().setup_environment()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            disable_distributed_sampler(trainer)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, _StepCallback) and c.strategy is self for c in callbacks):
            callbacks.insert(0, _StepCallback(self))  # before the user's: they see the step done
        host = self.options.host or os.environ.get(HOST_ENV) or "127.0.0.1"
        lighthouse = self.options.lighthouse
        if lighthouse is None:
            lighthouse = os.environ.get(LIGHTHOUSE_ENV)
            if not lighthouse:
                raise ValueError(
                    f"{OWNER}: no Lighthouse address: pass lighthouse='http://host:port' or set "
                    f"${LIGHTHOUSE_ENV} (python -m lightning_dist.launch.fault_tolerant starts one and sets it)"
                )
            check_lighthouse(lighthouse, f"${LIGHTHOUSE_ENV}", owner=OWNER)
        wait_for_lighthouse(lighthouse, self.options.timeout_s, owner=OWNER)
        replica_id = self.options.replica_id  # a str (FaultTolerantOptions)
        self.transport = FaultTolerantTransport(
            self._state_dict,
            self._load_state_dict,
            self._model_state,
            min_replica_size=self.options.min_replica_size,
            device_type=self.root_device.type,
            lighthouse=lighthouse,
            replica_id=os.environ.get(REPLICA_GROUP_ENV) if replica_id is None else str(replica_id),
            timeout=timedelta(seconds=self.options.timeout_s),
            quorum_timeout=timedelta(seconds=self.options.quorum_timeout_s),
            quorum_retries=self.options.quorum_retries,
            host=host,
            group_rank=self._group_rank,
            group_size=self._group_size,
            verbose=self.verbose,
        )
        self.store = CommitStore(self.commit_dir(trainer), self.options.keep)
        commit = self._agreed_commit()
        if commit is not None:
            # the floor: a group that finds live peers at a later step still recovers from them
            self._load_state_dict(commit.state["state"])
            self._compressor_from_commit()
            self.transport.resume(commit.step)
            self.resumed_from = commit.step
            rank_zero_info(
                resumed_message(commit.step, commit.path, self.commit_dir(trainer), trainer.max_steps)
            )

    def commit_dir(self, trainer: L.Trainer) -> str:
        """Where the commits are: ``dirpath``, else ``<trainer.default_root_dir>/ft_commits``."""
        return str(self.options.dirpath or os.path.join(trainer.default_root_dir, "ft_commits"))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.transport is not None:  # a resumed group's loop starts at its commit's step
            set_global_step(self._fit_trainer(), self.data_step(), logger_step=True)

    @override
    def teardown(self) -> None:
        if self.transport is not None:
            self.transport.shutdown()
            self.transport = None
        super().teardown()

    @property
    @override
    def is_global_zero(self) -> bool:
        return self._group_rank == 0

    def _fit_trainer(self) -> L.Trainer:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    # -- what a peer sends --------------------------------------------------------------------------
    def _model_state(self) -> Mapping[str, Tensor]:
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    def _state_dict(self) -> dict[str, Any]:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        schedulers = (
            [] if trainer is None else [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
        )
        state = {
            "model": dict(self._model_state()),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "schedulers": schedulers,
        }
        if self.compression is not None:  # split with the groups this one sends it to (if any)
            peers = 0 if self.transport is None else self.transport.recovering_peers
            state["compressor"] = self.compression.state(1 + peers)
        return state

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(state["model"])
        for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        trainer = self.lightning_module.trainer
        for config, sched_state in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(sched_state)
        if self.compression is not None and "compressor" in state:
            self.compression.receive(state["compressor"])  # applied at the step's start
        logger.info(
            "%s: recovered from a peer at step %d", OWNER, self.transport.step if self.transport else -1
        )

    def _compressor_from_commit(self) -> None:
        if self.compression is not None:
            self.compression.from_commit()

    def write_commit(self) -> None:
        """Commit the state of the last committed step, when this group is the quorum's participant 0
        (one writer) and no commit of that step exists."""
        if self.store is None or self.transport is None or not self.options.commit_every:
            return
        step = self.transport.step
        if self.transport.participant_rank != 0 or self._group_rank != 0 or step == 0:
            return
        if self.store.latest_step() == step:
            return
        self.store.save(step, {"state": self._state_dict(), "step": step})

    # -- data: slots ------------------------------------------------------------------------------
    @property
    def slots_per_step(self) -> int:
        """``M``: micro-batches per step over all groups."""
        return 1 if self.plan is None else self.plan.accumulate

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (
            trainer is None
            or trainer.state.stage != RunningStage.TRAINING
            or not isinstance(dataloader, DataLoader)
        ):
            return dataloader
        if dataloader.batch_size is None:
            raise ValueError(
                f"{OWNER}: the training DataLoader must be built with batch_size= (the micro-batch); "
                f"{OWNER} reads the samples of its slots itself"
            )
        micro = int(dataloader.batch_size)
        global_batch = self.options.global_batch or self.options.replica_groups * self._group_size * micro
        self.plan = ElasticPlan(
            dataset_len=len(dataloader.dataset),  # type: ignore[arg-type]
            global_batch=global_batch,
            world_size=1,
            micro_batch=micro,
            on_indivisible="error",
        )
        if trainer.accumulate_grad_batches not in (1, self.plan.accumulate):
            raise ValueError(
                f"{OWNER}: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}); {OWNER} "
                "accumulates the global batch's micro-batches itself (global_batch=); accepted: 1"
            )
        processes = self.options.replica_groups * self._group_size
        if self.plan.accumulate < processes:
            raise ValueError(
                f"{OWNER}: global_batch={global_batch} is {self.plan.accumulate} micro-batch(es) of "
                f"batch_size={micro}, fewer than the {processes} processes of replica_groups="
                f"{self.options.replica_groups} x {self._group_size}: every process trains a micro-batch "
                f"of each step; accepted: global_batch >= {processes * micro}"
            )
        trainer.accumulate_grad_batches = 1  # Lightning steps at every batch; a step's sum is ours
        self._dataset = dataloader.dataset
        self._collate = dataloader.collate_fn
        per_step = slots_per_process(self.plan.accumulate, processes)
        return OwnBatches(self._own_batches, self.plan.steps_per_epoch * per_step, dataloader.dataset)

    def _own_batches(self) -> Iterator[Any]:
        """This process's micro-batches of the fit's current epoch: at each step's start the quorum
        (``_start_step``), then the samples of each slot it owns, collated (Lightning moves them to the
        device and calls the transfer hooks). Lightning pulls one batch at a time, so the next step's
        quorum comes after this one's last batch has stepped. Ends once the committed steps reach
        the next data epoch (or a commit caught up to reaches ``max_steps``)."""
        assert self.plan is not None
        trainer = self._fit_trainer()
        per_epoch = self.plan.steps_per_epoch
        epoch: Optional[int] = self._step_epoch if self._queue else None
        while True:
            if not self._queue:
                if epoch is not None and self.data_step() // per_epoch > epoch:
                    return
                slots = self._start_step()
                if slots is None:  # caught up from a commit: that step is not run
                    if trainer.should_stop:
                        return
                    continue
                self._queue = slots
                epoch = self._step_epoch if epoch is None else epoch
            slot = self._queue.pop(0)
            self.last_in_step = not self._queue
            indices = self.slot_indices(self.data_step(), slot)
            self._step_indices += indices
            set_global_step(trainer, self.data_step(), logger_step=True)
            yield self._collate([self._dataset[i] for i in indices])

    def _start_step(self) -> Optional[list[int]]:
        """The slots of the step about to start that this process trains, after its quorum
        (``_begin_step``); None when the step is not run (``_skipping``). What the step may have to
        put back is taken here: the schedulers and the optimizers' hyperparameters."""
        self._begin_step()
        if self._skipping:
            return None
        assert self.plan is not None
        self._step_indices = []
        self._stepped = False
        self._step_epoch = self.data_step() // self.plan.steps_per_epoch
        self._schedulers = [c.scheduler.state_dict() for c in self._fit_trainer().lr_scheduler_configs]
        self._hyper = [[_hyperparameters(g) for g in opt.param_groups] for opt in self.optimizers]
        slots = [slot for slot in range(self.slots_per_step) if self.owns(slot)]
        if not slots:
            raise ValueError(
                f"{OWNER}: the quorum's {self._participants} group(s) x {self._group_size} process(es) are more "
                f"than the {self.slots_per_step} micro-batches of a step: this process would train none; "
                f"accepted: global_batch of at least (groups x processes) x batch_size"
            )
        return slots

    def _sampler(self, epoch: int) -> ElasticSampler:
        assert self.plan is not None
        if epoch not in self._samplers:
            self._samplers = {epoch: ElasticSampler(self.plan, 0, seed=self.options.seed, epoch=epoch)}
        return self._samplers[epoch]

    def slot_indices(self, step: int, slot: int) -> list[int]:
        """The dataset indices of ``slot`` of global step ``step`` (the same on every group)."""
        assert self.plan is not None
        epoch, in_epoch = divmod(step, self.plan.steps_per_epoch)
        return self._sampler(epoch).rank_batches(in_epoch, 0)[slot]

    def data_step(self) -> int:
        """The global step whose samples the current step trains, and the Trainer's ``global_step``:
        the committed steps (``FaultTolerantDiLoCo``: its inner steps)."""
        assert self.transport is not None
        return self.transport.step

    @property
    def participants(self) -> int:
        """Groups in the current step's quorum."""
        return self._participants

    def owns(self, slot: int) -> bool:
        """Whether this process computes ``slot`` of the current step (``owns_slot`` over the quorum's
        participants x the group's processes)."""
        rank = None if self._rank is None else self._rank * self._group_size + self._group_rank
        return owns_slot(slot, self._participants * self._group_size, rank)

    def _begin_step(self) -> None:
        """The step's quorum (a recovering group loads its peer's state in it); a group behind the
        newest commit catches up to it instead (``_skipping``: the step is not run)."""
        assert self.transport is not None
        self._join()
        self._participants = max(1, self.transport.participants)
        self._rank = self.transport.participant_rank
        self._skipping = self._catch_up()
        if self.compression is not None:
            self.compression.begin_step(self.transport.step, self.transport.recovering_peers)
        if self._skipping:
            self._rank = None  # this step's quorum was formed at the old step: it is not run
        trainer = self._fit_trainer()
        set_global_step(trainer, self.data_step(), logger_step=True)
        if self._skipping and trainer.max_steps >= 0 and self.data_step() >= trainer.max_steps:
            trainer.should_stop = True

    def _catch_up(self) -> bool:
        """A group alone in its quorum whose step is behind the newest commit (its peers went on and
        ended, or died, while it was stopped or restarting) loads that commit instead of training
        steps the job has already committed; True when it did."""
        assert self.transport is not None
        if self.transport.participants > 1 or self.store is None or not self.options.commit_every:
            return False
        latest = self.store.latest_step()
        newest = self.transport.group_agrees(-1 if latest is None else latest)
        if newest <= self.transport.step:
            return False
        commit = self._agreed_commit()
        if commit is None or commit.step <= self.transport.step:
            return False
        logger.warning(
            "%s: alone at step %d behind the commit of step %d: resuming from it",
            OWNER,
            self.transport.step,
            commit.step,
        )
        self._load_state_dict(commit.state["state"])
        self._compressor_from_commit()
        self.transport.resume(commit.step)
        self.resumed_from = commit.step
        return True

    def _join(self) -> None:
        """Join the step's quorum (a recovering group loads its peer's state here). The first step of
        a process that torchrun did not restart (a fresh run, or a whole job started again from its
        commits) asks again until ``start_groups`` groups are in it or ``quorum_timeout_s`` passed."""
        assert self.transport is not None
        deadline = time.monotonic() + self.options.quorum_timeout_s
        start_groups = self.options.start_groups or self.options.replica_groups
        wait = not self._joined and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        self._joined = True
        self.transport.start_step()
        # the group's processes decide together (they form each quorum together)
        while wait and self.transport.group_agrees(
            self.transport.participants < start_groups and time.monotonic() < deadline
        ):
            time.sleep(0.1)
            self.transport.start_step()
        if self.checks_group_sizes:
            self.transport.check_group_size()
        if wait and self.transport.participants < start_groups:
            logger.warning(
                "%s: %d of start_groups=%d groups joined within quorum_timeout_s=%s; starting with them",
                OWNER,
                self.transport.participants,
                start_groups,
                self.options.quorum_timeout_s,
            )

    def _agreed_commit(self) -> Optional[Commit]:
        """The newest intact commit, as the group's rank 0 found it (every process loads that one)."""
        assert self.store is not None and self.transport is not None
        if self.transport.group is None:
            return self.store.load_latest()
        commit = self.store.load_latest() if self._group_rank == 0 else None
        step = self.transport.group_agrees(-1 if commit is None else commit.step)
        if step < 0:
            return None
        return commit if commit is not None else self.store.load(step)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.transport is None or self.plan is None:
            return output
        return scaled_loss(output, self.slots_per_step)  # one of the step's M micro-batches

    # -- the step ---------------------------------------------------------------------------------
    def _reduce_gradients(self) -> None:
        """Sum every parameter's gradient over every process of the quorum's groups (one flat sum:
        ``sum_over_groups``; or the group's sum, then the compressor's exchange of it, the same on
        each of the group's processes, so they keep the same compressor state)."""
        assert self.transport is not None and self.lightning_module is not None
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.compression is not None:
            if self.transport.group is not None:
                grads = unflatten(
                    self.transport.sum_in_group(torch.cat([g.reshape(-1) for g in grads])), grads
                )
            summed = self.compression.reduce(self.transport.communicator, grads)
            for p, g in zip(params, summed, strict=True):
                p.grad = g.view_as(p)
            return
        flat = self.transport.sum_over_groups(torch.cat([g.reshape(-1) for g in grads]))
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if self.transport is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        loss = closure()  # this batch's forward and backward
        params = self._trainable()
        self._gradients.add(params)
        if not self.last_in_step:
            self._hide_schedulers()
            return loss  # more of the step's batches to come
        self._gradients.restore(params)
        self._stepped = False
        result = self._step(optimizer, loss, model, **kwargs)
        if not self._stepped:
            self._hide_schedulers()
        assert self.plan is not None
        if self.data_step() // self.plan.steps_per_epoch > self._step_epoch:
            mark_last_batch(self._fit_trainer())  # the data epoch's last step: Lightning's epoch ends
        return result

    def _hide_schedulers(self) -> None:
        """Lightning steps the schedulers after every batch's optimizer step: until the batch's
        end (``show_schedulers``) it finds none, unless the batch ended a committed step."""
        if self.lr_scheduler_configs:
            self._hidden_schedulers, self.lr_scheduler_configs = self.lr_scheduler_configs, []

    def show_schedulers(self) -> None:
        """Give Lightning its schedulers back (``_hide_schedulers``)."""
        if self._hidden_schedulers:
            self.lr_scheduler_configs, self._hidden_schedulers = self._hidden_schedulers, []

    def _trainable(self) -> list[Tensor]:
        assert self.lightning_module is not None
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    def _step(self, optimizer: Any, loss: Any, model: Any, **kwargs: Any) -> Any:
        """After the step's backward pass: the gradients summed over the quorum, the commit, and the
        optimizer step once it is committed."""
        assert self.transport is not None
        self._reduce_gradients()
        step = self.transport.step
        committed = self.transport.commit()
        if self.compression is not None:
            self.compression.end_step(committed)
        if not committed:
            self.uncommitted_steps += 1
            optimizer.zero_grad(set_to_none=True)
            logger.warning("%s: step %d not committed (a peer failed); the quorum runs it again", OWNER, step)
            return loss
        self.committed.append(StepRecord(step, list(self._step_indices), self._participants))
        self._stepped = True
        return super().optimizer_step(optimizer, lambda: loss, model, **kwargs)

    def undo_schedulers(self) -> None:
        """After a batch that did not end a committed step (one before the step's last, or a step
        that was not committed), put back the schedulers and the hyperparameters they set as they
        were at the step's start, so the learning rate follows committed steps only (Lightning does
        not step them then: ``_hide_schedulers``)."""
        if self._stepped:
            return
        for config, state in zip(self._fit_trainer().lr_scheduler_configs, self._schedulers):
            config.scheduler.load_state_dict(state)
        for opt, groups in zip(self.optimizers, self._hyper):  # what the schedulers set (lr, momentum)
            for group, saved in zip(opt.param_groups, groups):
                group.update(saved)
