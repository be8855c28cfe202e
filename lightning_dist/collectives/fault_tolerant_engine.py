"""Starting one replica group's torchft engine from a strategy's options: where its processes stand
in the group, which Lighthouse it joins, and the ``FaultTolerantTransport`` it runs on, with the
timeouts derived from ``peer_timeout_s`` (printed once per group: ``fault_tolerant_timeouts``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Optional, Union

from torch import Tensor

from lightning_dist.collectives.fault_tolerant import (
    HOST_ENV,
    LIGHTHOUSE_ENV,
    REPLICA_GROUP_ENV,
    FaultTolerantTransport,
)
from lightning_dist.collectives.fault_tolerant_addresses import check_lighthouse, wait_for_lighthouse
from lightning_dist.collectives.fault_tolerant_events import logger as events_logger

OWNER = "FaultTolerant"


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


def start_transport(
    options: Any,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
    model_state: Callable[[], Mapping[str, Tensor]],
    *,
    device_type: str,
    group_rank: int,
    group_size: int,
    verbose: bool,
) -> FaultTolerantTransport:
    """The group's engine, once its Lighthouse answers (``options``: ``FaultTolerantOptions``; the
    Lighthouse, host and replica id default to the launcher's environment)."""
    host = options.host or os.environ.get(HOST_ENV) or "127.0.0.1"
    lighthouse = options.lighthouse
    if lighthouse is None:
        lighthouse = os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(
                f"{OWNER}: no Lighthouse address: pass lighthouse='http://host:port' or set "
                f"${LIGHTHOUSE_ENV} (python -m lightning_dist.launch.fault_tolerant starts one and sets it)"
            )
        check_lighthouse(lighthouse, f"${LIGHTHOUSE_ENV}", owner=OWNER)
    timeouts = options.timeouts
    wait_for_lighthouse(lighthouse, timeouts.startup_s, owner=OWNER)
    replica_id: Optional[Union[str, int]] = options.replica_id  # a str (FaultTolerantOptions)
    transport = FaultTolerantTransport(
        state_dict,
        load_state_dict,
        model_state,
        min_replica_size=options.min_replica_size,
        device_type=device_type,
        lighthouse=lighthouse,
        replica_id=os.environ.get(REPLICA_GROUP_ENV) if replica_id is None else str(replica_id),
        timeout=timedelta(seconds=timeouts.collective_s),
        quorum_timeout=timedelta(seconds=timeouts.quorum_s),
        group_timeout=timedelta(seconds=timeouts.group_s),
        quorum_retries=options.quorum_retries,
        host=host,
        group_rank=group_rank,
        group_size=group_size,
        verbose=verbose,
    )
    if group_rank == 0:  # once per group, at start: what every timeout is and where it came from
        events_logger.info(timeouts.line())
    return transport
