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

``reduce_op="adasum"``: each group's mean over its own samples is combined with the other groups' by
Adasum per tensor, in the quorum's rank order; each committed step is one quorum's (docs/live-recovery.md).

``compressor=`` sends the gradients through one of the pack's compressors (``Compressed``'s names
and objects); its state follows the groups across failures (``fault_tolerant_compression``).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.utilities.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_dist.algorithms.micro_batch_slots import owns_slot as owns_slot
from lightning_dist.collectives import Communicator
from lightning_dist.collectives.fault_tolerant import require_torchft
from lightning_dist.collectives.fault_tolerant_engine import group_place, start_transport
from lightning_dist.collectives.fault_tolerant_logs import configure_torchft_logs, verbose_wanted
from lightning_dist.compat import disable_distributed_sampler, set_global_step
from lightning_dist.compression import COMPRESSORS, Compressor
from lightning_dist.compression.builder import build_compressor
from lightning_dist.strategies.batch_shares import FAULT_TOLERANT_SHARES, refuse_shares
from lightning_dist.strategies.collective_ops import CollectiveOpsMixin
from lightning_dist.strategies.fault_tolerant_callback import install_step_callback
from lightning_dist.strategies.fault_tolerant_slots import FaultTolerantSlots
from lightning_dist.strategies.fault_tolerant_state import OWNER, StepRecord
from lightning_dist.strategies.launch_needs import TORCHFT
from lightning_dist.strategies.names import register_class
from lightning_dist.strategies.options import FAULT_TOLERANT_REDUCE_OPS, op_name, option_names, options_from
from lightning_dist.strategies.options_resilience import FaultTolerantOptions
from lightning_dist.wire.fault_tolerant_compression import CompressedGradients

__all__ = ["FaultTolerant", "StepRecord", "group_place", "owns_slot"]


class FaultTolerant(CollectiveOpsMixin, FaultTolerantSlots):
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
        peer_timeout_s: the one timeout: how long a peer may be silent (stopped, hung, cut off)
            before the others go on without it; every other timeout is derived from it and printed
            once at start (``lightning_dist.collectives.fault_tolerant_timeouts``). A peer whose
            process dies is not waited for: the others learn it from its closed connections and the
            Lighthouse's heartbeats (the launcher's ``--heartbeat-timeout-ms``).
        timeout_s: overrides the collectives', commits', checkpoint transfers' and start-up
            timeout (default: ``peer_timeout_s``).
        quorum_timeout_s: overrides how long a quorum may take to form (default: ``peer_timeout_s``).
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
        reduce_op: how the quorum's groups' gradients combine: ``"avg"`` (their sum, each micro-batch
            loss divided by the step's ``M``: the mean over the step's samples), or ``"adasum"``
            (``DDP(reduce_op="adasum")``'s gradient-space Adasum per parameter tensor, of each group's
            mean gradient over its own slots; module docstring). With a compressor, ``"adasum"``
            takes those whose exchange is one all-reduce (``none``, ``fp16``, ``bf16``).
        **compressor_options: the named compressor's options (``rank=2``).
    """

    strategy_name = "ld_fault_tolerant"
    launch_needs = TORCHFT

    def __init__(
        self,
        replica_groups: int = 2,
        global_batch: Optional[int] = None,
        min_replica_size: int = 1,
        lighthouse: Optional[str] = None,
        replica_id: Optional[Union[str, int]] = None,
        host: Optional[str] = None,
        peer_timeout_s: float = 60.0,
        timeout_s: Optional[float] = None,
        quorum_timeout_s: Optional[float] = None,
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
        reduce_op: str = "avg",
        **compressor_options: Any,
    ) -> None:
        refuse_shares(OWNER, compressor_options, FAULT_TOLERANT_SHARES)
        self.options = options_from(FaultTolerantOptions, locals())
        self.reduce_op = op_name(reduce_op, FAULT_TOLERANT_REDUCE_OPS, argument="reduce_op", default="avg")
        accepted = [*option_names(FaultTolerantOptions), "device", "compressor", "reduce_op"]
        if compressor is None and compressor_options:
            raise ValueError(
                f"{OWNER} got unknown option(s) {', '.join(sorted(compressor_options))}; compressor options "
                f"need compressor= (a name or a Compressor); accepted: {', '.join(accepted)}"
            )
        self.compression = None
        if compressor is not None:
            built = build_compressor(
                compressor, COMPRESSORS, options=compressor_options, owner=OWNER, strategy_options=accepted
            )
            self.compression = CompressedGradients(built, adasum=self.reduce_op == "adasum", owner=OWNER)
        self.register_peer_state()
        self.verbose = verbose_wanted(self.options.verbose)
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

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_class(strategy_registry, cls)

    # -- the transport ----------------------------------------------------------------------------
    @property
    def communicator(self) -> Optional[Communicator]:
        """The collectives over the quorum (``CommMonitor`` reads its counters)."""
        return None if self.transport is None else self.transport.communicator

    @property
    def is_distributed(self) -> bool:
        """Lightning syncs ``self.log(..., sync_dist=True)`` through ``reduce``, over the quorum."""
        return True

    @override
    def _transport(self) -> Communicator:
        """Lightning's reduce, all_gather, broadcast and barrier span every process of the quorum's
        groups (``FaultTolerantTransport.quorum``); before setup and after teardown, this one."""
        return super()._transport() if self.transport is None else self.transport.quorum

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        comm = self._transport()
        votes = comm.all_reduce(torch.tensor([float(decision)], device=self.root_device), "sum")
        return int(votes.item()) == comm.world_size if all else votes.item() > 0

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
        install_step_callback(trainer, self)
        self.transport = start_transport(
            self.options,
            self._state_dict,
            self._load_state_dict,
            self._model_state,
            device_type=self.root_device.type,
            group_rank=self._group_rank,
            group_size=self._group_size,
            verbose=self.verbose,
        )
        self.open_commits(trainer)

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
