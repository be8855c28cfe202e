"""Transport over torchft: one replica group's ``Manager`` (quorum through the Lighthouse, a Gloo or
NCCL process group reconfigured in place at every new quorum, live recovery from a peer over HTTP)
and a ``Backend`` whose all-reduce goes through it, so a strategy's bytes are counted like any other.

A replica group may be several processes (torchrun ``--nproc-per-node=G``, the same G in every group):
each builds a Manager with its rank in the group (rank 0 hosts the group's quorum server), torchft joins
rank r of every group in the cross-group process group of lane r and a recovering rank fetches its
peer group's rank r state; the group's own processes share a plain Gloo (NCCL) process group over
torchrun's store (``FaultTolerantTransport.group``), and ``sum_over_groups`` sums a tensor over every
process of every live group (reduce-scatter in the group, each lane's shard across the groups,
all-gather in the group).

torchft does the quorum, the reconfiguration and the transfer; this module only builds them for a
strategy, checks what a recovering group receives (``checked_state``), and makes the checkpoint
server listen on one address and load with ``weights_only`` (``SafeHTTPTransport``).

torchft is an optional dependency (``pip install '.[ft]'`` from a checkout); importing this module
without it works, building a transport raises ``ImportError`` saying what to install.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any, Optional, cast

import torch
from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_dist.collectives.backend import Backend
from lightning_dist.collectives.communicator import Communicator
from lightning_dist.collectives.fault_tolerant_events import RecoveryEvents, group_of, show_events
from lightning_dist.collectives.fault_tolerant_quorum import QuorumBackend
from lightning_dist.collectives.fault_tolerant_timeouts import HEARTBEAT_INTERVAL_S
from lightning_dist.collectives.futures import completed_future
from lightning_dist.collectives.torch_backend import TorchBackend

logger = logging.getLogger(__name__)

TORCHFT_PIN = "torchft==0.2.0"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's variable for the Lighthouse address (``http://host:port``)."""
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
"""The replica group's id (torchft's examples use this name); set by the pack's launch helper."""
HOST_ENV = "LD_FT_HOST"
"""The address a replica group's servers listen on and advertise (default 127.0.0.1)."""


def torchft_available() -> bool:
    """Whether torchft imports here."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


def require_torchft(owner: str = "FaultTolerant") -> None:
    """Raise ``ImportError`` naming the extra to install when torchft is missing."""
    if not torchft_available():
        raise ImportError(
            f"{owner} needs torchft: pip install '.[ft]' from a checkout of lightning-dist, or "
            f"pip install '{TORCHFT_PIN}' (wheels for Linux x86_64, CPython 3.10-3.13 only)"
        )


def _tensor_leaves(state: Any, prefix: str = "") -> dict[str, Tensor]:
    """Every tensor in a nested dict/list state, by its path."""
    out: dict[str, Tensor] = {}
    if isinstance(state, Tensor):
        out[prefix] = state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            out.update(_tensor_leaves(value, f"{prefix}/{key}"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            out.update(_tensor_leaves(value, f"{prefix}/{i}"))
    return out


def state_checksum(state: Any) -> int:
    """A checksum of every tensor's path, dtype, shape and bytes in ``state`` (order-independent of
    dict insertion: paths are sorted)."""
    import zlib

    crc = 0
    for path, t in sorted(_tensor_leaves(state).items()):
        crc = zlib.crc32(f"{path}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


def checked_state(received: Any, expected_step: int, like: Mapping[str, Tensor]) -> Any:
    """``received`` (a peer's state, stamped by ``stamp_state``) after checking it before anything
    trains on it: its step is ``expected_step``, its checksum matches its tensors, and each tensor
    in ``like`` (the recovering group's own model state) has the same shape and dtype there.
    Raises ``ValueError`` naming what differs."""
    if not isinstance(received, Mapping) or "state" not in received:
        raise ValueError(
            "FaultTolerant: the peer's state is not a stamped state (keys: state, step, checksum)"
        )
    if received.get("step") != expected_step:
        raise ValueError(
            f"FaultTolerant: the peer sent the state of step {received.get('step')}, the quorum agreed on "
            f"step {expected_step}"
        )
    state = received["state"]
    if state_checksum(state) != received.get("checksum"):
        raise ValueError(
            "FaultTolerant: the peer's state does not match its checksum (corrupted in transfer)"
        )
    model = state.get("model", {}) if isinstance(state, Mapping) else {}
    for name, mine in like.items():
        theirs = model.get(name)
        if not isinstance(theirs, Tensor) or theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            got = "missing" if not isinstance(theirs, Tensor) else f"{tuple(theirs.shape)} {theirs.dtype}"
            raise ValueError(
                f"FaultTolerant: the peer's model entry {name!r} is {got}, this group's is "
                f"{tuple(mine.shape)} {mine.dtype}: the groups train different models"
            )
    return state


def stamp_state(state: Any, step: int) -> dict[str, Any]:
    """``state`` with its step and checksum, as a peer sends it."""
    return {"state": state, "step": step, "checksum": state_checksum(state)}


def _safe_http_transport(timeout: timedelta, host: str, verbose: bool = False) -> Any:
    """torchft's ``HTTPTransport``, serving on ``host`` only (torchft's listens on every interface)
    and loading what it fetches with ``weights_only=True`` (torchft's unpickles anything); unless
    ``verbose``, without a line on stderr per request served or torch's warning that the received
    buffer is read-only (the state is copied into the model and optimizers)."""
    import urllib.request
    import warnings

    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.http import _IPv6HTTPServer

    class SafeHTTPTransport(HTTPTransport):  # type: ignore[misc, type-arg]
        """``HTTPTransport`` bound to ``host`` and loading with ``weights_only``."""

        def __init__(self) -> None:
            super().__init__(timeout=timeout, num_chunks=0)
            # torchft's server listens on every interface: replaced before any use
            old: Any = getattr(self, "_server")  # noqa: B009
            handler = old.RequestHandlerClass
            if not verbose:

                class _QuietHandler(handler):  # type: ignore[misc, valid-type]
                    @override
                    def log_message(self, format: str, *args: Any) -> None:
                        logger.debug(format, *args)

                handler = _QuietHandler
            old.shutdown()
            old.server_close()
            getattr(self, "_thread").join()  # noqa: B009
            family = socket.AF_INET6 if ":" in host else socket.AF_INET

            class _Server(_IPv6HTTPServer):  # type: ignore[misc]
                address_family = family

            self._server = _Server((host, 0), handler)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

        @override
        def _serve(self) -> None:
            super()._serve()
            self._server.server_close()  # once its loop has ended: nothing polls a closed socket

        @override
        def shutdown(self, wait: bool = True) -> None:
            # torchft's wait=False sets a name-mangled flag the server never reads, so its loop ran on
            setattr(self._server, "_BaseServer__shutdown_request", True)  # noqa: B010
            if wait:
                self._thread.join()

        @override
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            return f"http://{shown}:{port}/checkpoint/"

        @classmethod
        @override
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with (
                urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f,
                warnings.catch_warnings(),
            ):
                if not verbose:
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return _streaming_load(f, weights_only=True)

    return SafeHTTPTransport()


def bound_gloo_options(timeout: timedelta, host: str) -> Any:
    """Options of a Gloo process group whose connections listen on ``host`` (torch's default device
    takes the address the host name resolves to, or ``$GLOO_SOCKET_IFNAME``'s)."""
    gloo = cast(Any, torch.distributed.ProcessGroupGloo)
    options = gloo._Options()
    options._timeout = timeout
    options._devices = [gloo.create_device(hostname=host)]
    return options


def _bound_gloo_group(timeout: timedelta, host: str) -> Any:
    """torchft's reconfigurable ``ProcessGroupGloo`` whose Gloo connections listen on ``host``
    (torch's default Gloo device takes the address the machine's host name resolves to, or
    ``$GLOO_SOCKET_IFNAME``'s, whatever network the job uses)."""
    from torch.distributed import ProcessGroup
    from torch.distributed import ProcessGroupGloo as GlooBackend
    from torchft.process_group import ProcessGroupGloo

    class BoundProcessGroupGloo(ProcessGroupGloo):  # type: ignore[misc]
        """torchft's ``_create_pg`` for Gloo with the device bound to ``host``."""

        @override
        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            backend = GlooBackend(store, rank, world_size, bound_gloo_options(self._timeout, host))
            backend._set_sequence_number_for_group()
            if self._global_ranks:
                backend.options.global_ranks_in_group = self._global_ranks
            if self._group_rank and self._group_world_size:
                lane = self._group_rank % self._group_world_size
                cast(Any, backend.options).group_name = f"torchft_quorum_{self._quorum_id}_rank_{lane}"
            pg = ProcessGroup(store, rank, world_size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
            if torch.cuda.is_available():
                pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, backend)
            return pg

    return BoundProcessGroupGloo(timeout=timeout)


@contextlib.contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """While torchft's ``Manager`` is built, its ``ManagerServer`` (rank 0's quorum server) binds to
    ``host`` instead of every interface (``Manager`` hard-codes ``[::]:port``); the port is kept."""
    import torchft.manager as manager_module

    real = manager_module.ManagerServer

    def bound(**kwargs: Any) -> Any:
        port = str(kwargs["bind"]).rsplit(":", 1)[1]
        kwargs["bind"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return real(**kwargs)

    manager_module.ManagerServer = bound  # type: ignore[assignment]
    try:
        yield
    finally:
        manager_module.ManagerServer = real  # type: ignore[misc]


def _loopback(addr: str) -> bool:
    """Whether ``addr`` names this machine's loopback only (peers elsewhere cannot reach it)."""
    import ipaddress

    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


class ManagedBackend(Backend):
    """Collectives among the replica groups in the current quorum, through torchft's ``Manager``.

    ``all_reduce`` is the Manager's fault-tolerant all-reduce: a peer's failure is recorded (the
    step is then not committed) instead of raised, and a group not participating contributes zeros.
    ``all_gather``, ``all_to_all`` (the compressors' other rounds), ``broadcast``, ``barrier`` and a
    ``min``/``max`` all-reduce (Lightning's) run on the Manager's current process group under the same
    contract: a failure is reported to the Manager (``wrap_future``)
    instead of raised, and once the step has failed they return zeros without communicating; what
    they return in a failed step is meaningless, and the step is not committed. Rank and world size
    are this group's place in the quorum. The others (``reduce_scatter``, ``send``, ``recv``) run on
    the current process group (a failure raises)."""

    name = "torchft"

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._torch: Optional[tuple[int, TorchBackend]] = None

    @property
    def transport(self) -> str:
        return str(self.manager._pg.getBackendName())

    @property
    @override
    def rank(self) -> int:
        rank = self.manager.participating_rank()
        return 0 if rank is None else int(rank)

    @property
    @override
    def world_size(self) -> int:
        return max(1, int(self.manager.num_participants()))

    @property
    @override
    def device_type(self) -> str:
        return "cuda" if "nccl" in self.transport else "cpu"

    @override
    def all_reduce(self, tensor: Tensor, op: str, name: Optional[str] = None) -> Future:
        from torch.distributed import ReduceOp

        if op in ("min", "max"):  # not the Manager's: on its current process group, failures reported
            return self._managed(lambda: self._current().all_reduce(tensor, op), tensor)
        if op not in ("sum", "avg"):
            raise ValueError(f"ManagedBackend.all_reduce: op={op!r}; accepted: 'sum', 'avg', 'min', 'max'")
        if op == "avg":
            tensor.div_(self.world_size)  # divide first, then sum, as TorchBackend does
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return completed_future(tensor)

    def _current(self) -> TorchBackend:
        """A ``TorchBackend`` over the Manager's current (latest configured) process group."""
        group = self.manager._pg.parent
        if self._torch is None or self._torch[0] != id(group):
            self._torch = (id(group), TorchBackend(group))
        return self._torch[1]

    @override
    def native_adasum(self, tensors: list[Tensor]) -> Optional[tuple[int, int]]:
        """The library's Adasum (``adasum_all_reduce``) on the Manager's current process group, under
        the contract of the other collectives here: once the step has failed, or when a peer fails
        during it (reported to the Manager), the tensors are zeros and the step is not committed."""
        from lightning_dist.collectives.adasum import adasum_all_reduce

        if self.manager.errored() is None:
            try:
                return adasum_all_reduce(self._current(), tensors)
            except Exception as exc:  # noqa: BLE001  (the Manager records it; the step is not committed)
                self.manager.report_error(exc)
        for t in tensors:
            t.zero_()
        return 0, 0

    @override
    def broadcast(self, tensor: Tensor, src: int) -> Future:
        return self._managed(lambda: self._current().broadcast(tensor, src), tensor)

    def _managed(self, start: Callable[[], Future], default: Any) -> Future:
        """``start()``'s result, or ``default`` once the step has failed (reported to the Manager,
        as ``Manager.allreduce`` does, so the step is not committed)."""
        if self.manager.errored():
            return completed_future(default)
        try:
            fut = start()
        except Exception as exc:  # noqa: BLE001  (the Manager records it; the step is not committed)
            self.manager.report_error(exc)
            return completed_future(default)
        return completed_future(self.manager.wrap_future(fut, default).wait())

    @override
    def all_gather(self, tensor: Tensor) -> Future:
        default = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        return self._managed(lambda: self._current().all_gather(tensor), default)

    @override
    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: str) -> Future:
        return self._current().reduce_scatter(output, inputs, op)

    @override
    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Future:
        return self._managed(
            lambda: self._current().all_to_all(outputs, inputs), [o.zero_() for o in outputs]
        )

    @override
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Future:
        return self._current().send(tensor, dst, tag)

    @override
    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Future:
        return self._current().recv(tensor, src, tag)

    @override
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """The pickled broadcast; ``obj`` itself once the step has failed (nothing was received)."""
        try:
            return super().broadcast_object(obj, src)
        except Exception:
            if self.manager.errored() is None:
                raise
            return obj

    @override
    def barrier(self) -> None:
        self._managed(lambda: completed_future(self._current().barrier()), None)

    @override
    def close(self) -> None:
        if self._torch is not None:
            self._torch[1].close()


class _QuorumRecorder:
    """torchft's ``ManagerClient``, keeping the result of the last quorum (who sends state to whom)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


_TORCHFT_GROUP_KEYS = ("manager_addr", "replica_id")
"""torchft's keys in the group's store (``torchft.manager.MANAGER_ADDR_KEY``, ``REPLICA_ID_KEY``)."""


def _group_store(timeout: timedelta) -> Any:
    """A client of torchrun's store (``MASTER_ADDR``/``MASTER_PORT``); ``ValueError`` outside torchrun."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError(
            f"FaultTolerant: WORLD_SIZE={os.environ.get('WORLD_SIZE')} but no MASTER_ADDR/MASTER_PORT: a "
            "replica group of several processes runs under torchrun (--nproc-per-node=G); accepted: "
            "torchrun's environment, or WORLD_SIZE=1"
        )
    return torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        wait_for_workers=False,
        timeout=timeout,
    )


def replica_group(
    rank: int, size: int, device_type: str, timeout: timedelta, host: str
) -> tuple[Communicator, Any]:
    """A ``Communicator`` over a new process group of the replica group's ``size`` processes (Gloo
    listening on ``host``, NCCL for CUDA) on torchrun's store, under a prefix of torchrun's attempt (a
    restarted group never meets its predecessor's keys), and that process group. torchft's keys of an earlier attempt are removed
    by rank 0 before the others pass the group's first barrier (the Manager is built after it)."""
    store = _group_store(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = torch.distributed.PrefixStore(f"lightning_dist/ft_group/{attempt}", store)
    if device_type == "cuda":
        nccl = torch.distributed.ProcessGroupNCCL  # type: ignore[attr-defined]
        options = nccl.Options()
        options._timeout = timeout
        pg: Any = nccl(prefixed, rank, size, options)
    else:
        gloo = cast(Any, torch.distributed.ProcessGroupGloo)
        pg = gloo(prefixed, rank, size, bound_gloo_options(timeout, host))
    group = Communicator(TorchBackend(pg))
    if rank == 0:
        for key in _TORCHFT_GROUP_KEYS:
            store.delete_key(key)
    group.barrier()
    return group, pg


class FaultTolerantTransport:
    """One replica group's torchft engine, owned by its strategy: the reconfigurable process group
    (Gloo, or NCCL for CUDA), the checkpoint transport, the ``Manager`` and a ``Communicator`` over
    ``ManagedBackend``; with several processes in the group (``WORLD_SIZE`` > 1, torchrun's), the
    group's own process group too (``group``).

    ``state_dict``/``load_state_dict``: what a healthy group sends and a recovering one loads (the
    strategy's model, optimizers and its own state); ``verbose``: the checkpoint server logs each
    request (``fault_tolerant_logs``); the received state is checked
    (``checked_state``) before ``load_state_dict`` sees it. The Manager runs the quorum synchronously
    at ``start_step``, so a recovering group has its peer's state before its first forward pass.
    """

    def __init__(
        self,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        model_state: Callable[[], Mapping[str, Tensor]],
        *,
        min_replica_size: int,
        device_type: str,
        lighthouse: Optional[str],
        replica_id: Optional[str],
        timeout: timedelta,
        quorum_timeout: timedelta,
        host: str,
        group_timeout: Optional[timedelta] = None,
        quorum_retries: int = 0,
        group_rank: int = 0,
        group_size: int = 1,
        verbose: bool = False,
    ) -> None:
        require_torchft()
        from torchft import Manager
        from torchft.process_group import ProcessGroupNCCL

        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self._model_state = model_state
        self.store: Optional[torch.distributed.TCPStore] = None
        self.group_rank = group_rank
        """This process's rank in its replica group (torchrun's ``RANK``)."""
        self.group_size = group_size
        """The replica group's processes (torchrun's ``WORLD_SIZE``; the same in every group)."""
        self.group: Optional[Communicator] = None
        """The replica group's own collectives (None: one process). Its timeout covers a peer lane's
        cross-group wait (two ``timeout``) and a quorum: how far the group's processes may drift apart."""
        self._group_pg: Any = None
        if self.group_size > 1:
            self.group, self._group_pg = replica_group(
                self.group_rank,
                self.group_size,
                device_type,
                group_timeout or timeout * 2 + quorum_timeout,
                host,
            )
        store_addr, store_port = self._store_address(host)
        pg = ProcessGroupNCCL(timeout=timeout) if device_type == "cuda" else _bound_gloo_group(timeout, host)
        self.checkpoint_transport = _safe_http_transport(timeout, host, verbose)
        with _manager_server_on(host):
            self.manager = Manager(
                pg=pg,
                load_state_dict=self._load_checked,
                state_dict=self._stamped,
                min_replica_size=min_replica_size,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=quorum_timeout,
                store_addr=store_addr,
                store_port=store_port,
                rank=self.group_rank,
                world_size=self.group_size,
                lighthouse_addr=lighthouse,
                replica_id=replica_id,
                hostname=host,
                checkpoint_transport=self.checkpoint_transport,
                quorum_retries=quorum_retries,
                heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
            )
        self._checked_quorum: Optional[int] = None
        self.replica_id: str = self.manager._store.get(_TORCHFT_GROUP_KEYS[1]).decode()
        """torchft's id of this group's current process(es): ``<replica_id>:<uuid>``."""
        show_events()
        self.events = RecoveryEvents(timeout.total_seconds(), speaks=group_rank == 0)
        """One log line per failure and recovery (``fault_tolerant_events``)."""
        self._received_bytes: Optional[int] = None
        self._quorums = _QuorumRecorder(self.manager._client)
        self.manager._client = self._quorums
        self.communicator = Communicator(ManagedBackend(self.manager))
        self.quorum = (
            self.communicator
            if self.group is None
            else Communicator(QuorumBackend(self.communicator, self.group))
        )
        """Collectives over every process of the quorum's groups (Lightning's, for ``FaultTolerant``)."""

    def _store_address(self, host: str) -> tuple[str, int]:
        """The replica group's TCPStore: torchrun's (MASTER_ADDR/MASTER_PORT), else one this process
        hosts on ``host``. Peers in other groups connect to it when this group leads a quorum, so a
        loopback MASTER_ADDR (``torchrun --standalone``) is advertised as ``host`` instead (torchrun's
        store listens on every interface)."""
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            addr = os.environ["MASTER_ADDR"]
            if _loopback(addr) and not _loopback(host):
                addr = host
            return addr, int(os.environ["MASTER_PORT"])
        self.store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return host, int(self.store.port)

    def _stamped(self) -> dict[str, Any]:
        return stamp_state(self._state_dict(), self.manager.current_step())

    def _load_checked(self, received: dict[str, Any]) -> None:
        # torchft sets its step from the peer's torchft entry before it applies the user state
        state = checked_state(received, self.manager.current_step(), self._model_state())
        self._received_bytes = sum(t.nbytes for t in _tensor_leaves(state).values())
        self._load_state_dict(state)

    # -- per step ---------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Join the quorum of the next step (a recovering group loads its peer's state here); the
        quorum's and the heal's event lines (``fault_tolerant_events``)."""
        started = time.monotonic()
        self._received_bytes = None
        self.manager.start_quorum()
        quorum = self._quorums.last
        if quorum is None:
            return
        ids = list(quorum.replica_ids)
        self.events.quorum(ids, self.replica_id, self.step, started)
        source = quorum.recover_src_replica_rank
        if self._received_bytes is not None and source is not None and 0 <= source < len(ids):
            self.events.healed(
                group_of(self.replica_id),
                group_of(ids[source]),
                self.step,
                self._received_bytes,
                time.monotonic() - started,
            )

    def resume(self, step: int) -> None:
        """Start at committed ``step`` (a commit was loaded): the quorum then sees this group there."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def commit(self) -> bool:
        """Whether every group of the quorum finished the step; the optimizer steps only then."""
        committed = bool(self.manager.should_commit())
        if not committed:
            self.events.step_failed(self.step, self.manager.errored())
        return committed

    def report_error(self, error: Exception) -> None:
        """Mark the current step failed, so it is not committed: for a collective that raised outside
        the Manager's all-reduce (those on the current process group, e.g. an all-gather)."""
        self.manager.report_error(error)

    def sum_over_groups(self, flat: Tensor) -> Tensor:
        """``flat`` summed over every process of every group in the quorum. One process per group:
        the Manager's all-reduce. Several: a reduce-scatter in the group, the Manager's all-reduce of
        this rank's shard with the same rank of the other groups, and an all-gather in the group
        (each lane carries 1/G of the bytes). A failed peer fails the step as ``ManagedBackend``
        says (the group's processes vote in ``commit``)."""
        if self.group is None:
            self.communicator.all_reduce(flat, "sum")
            return flat
        n, size = flat.numel(), self.group.world_size
        padded = torch.cat([flat, flat.new_zeros((-n) % size)]) if n % size else flat
        shard = self.group.reduce_scatter(padded, "sum")
        self.communicator.all_reduce(shard, "sum")
        out = torch.empty_like(padded)
        self.group.all_gather_into(out, shard)
        return out[:n]

    def adasum_over_groups(self, tensors: list[Tensor]) -> None:
        """Adasum of each tensor over the quorum's groups (each group's value: the same on all of its
        processes), in place, in the quorum's rank order (torchft's, by replica id), so every process
        ends with the same tensors. One process per group: ``ManagedBackend``'s Adasum. Several: lane
        ``r`` combines tensors ``r, r + G, ...`` with the same lane of the other groups, and a sum in
        the group (each tensor non-zero on its own lane only, so the sum is exact) gives each process
        all of them. A failed peer fails the step as ``ManagedBackend`` says."""
        if self.group is None:
            self.communicator.all_reduce(tensors, "adasum")
            return
        size, lane = self.group.world_size, self.group_rank
        mine = tensors[lane::size]
        if mine:
            self.communicator.all_reduce(mine, "adasum")
        for i, t in enumerate(tensors):
            if i % size != lane:
                t.zero_()
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.group.all_reduce(flat, "sum")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def sum_in_group(self, flat: Tensor) -> Tensor:
        """``flat`` summed over the replica group's processes, in place (one process: as it is)."""
        if self.group is not None:
            self.group.all_reduce(flat, "sum")
        return flat

    def group_agrees(self, value: int) -> int:
        """The group's rank 0's ``value`` on every process of the group (a decision they must share)."""
        if self.group is None:
            return value
        return int(self.group.broadcast(torch.tensor([value], dtype=torch.int64), 0).item())

    def check_group_size(self) -> None:
        """On the first call in each new quorum (every group of the quorum makes it at the same
        point: a collective): whether every group has this group's number of processes, by a Manager
        all-reduce of it on each lane; ``ValueError`` when they differ. Nothing is checked when the
        step has already failed or this group does not participate."""
        from torch.distributed import ReduceOp

        quorum = self._quorums.last
        if quorum is None or quorum.quorum_id == self._checked_quorum:
            return
        self._checked_quorum = quorum.quorum_id
        if self.participant_rank is None or self.errored:
            return
        sizes = torch.tensor([float(self.group_size), 1.0])
        self.manager.allreduce(sizes, reduce_op=ReduceOp.SUM).wait()
        if self.errored:
            return
        total, groups = int(sizes[0].item()), int(sizes[1].item())
        if total != groups * self.group_size:
            raise ValueError(
                f"FaultTolerant: this replica group has {self.group_size} process(es) (torchrun "
                f"--nproc-per-node), the {groups} groups of the quorum {total} together: every replica "
                "group must run the same number of processes; accepted: the same --nproc-per-node "
                "(--nproc-per-group) in every group"
            )

    @property
    def step(self) -> int:
        """Committed steps (the global step every group agrees on)."""
        return int(self.manager.current_step())

    @property
    def participants(self) -> int:
        return int(self.manager.num_participants())

    @property
    def participant_rank(self) -> Optional[int]:
        rank = self.manager.participating_rank()
        return None if rank is None else int(rank)

    @property
    def recovering_peers(self) -> int:
        """Groups that fetch this group's state in the current quorum (torchft's
        ``recover_dst_replica_ranks``); read in the quorum thread while the state is sent, and after."""
        quorum = self._quorums.last
        return 0 if quorum is None else len(quorum.recover_dst_replica_ranks)

    @property
    def errored(self) -> bool:
        return self.manager.errored() is not None

    def shutdown(self) -> None:
        self.quorum.close()
        self.communicator.close()
        if self.group is not None:
            self.group.close()
            self.group = self._group_pg = None
        self.manager.shutdown(wait=False)  # the checkpoint server's thread ends within its poll interval
