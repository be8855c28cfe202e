"""A process-group store for workers restarted by torchrun's elastic agent."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional


def attempt_store(timeout: timedelta) -> Optional[Any]:
    """The agent's store, with keys scoped to this restart attempt; None outside torchelastic.

    With ``TORCHELASTIC_USE_AGENT_STORE=True`` (``--standalone`` and the c10d rendezvous) every
    attempt's workers meet in the same agent store, so a restarted rank can read the address a dead
    rank of the previous attempt published and fail with "connectFullMesh ... Connection refused".
    Prefixing the keys with the restart count keeps attempts apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(
        f"lightning_dist/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
    )
