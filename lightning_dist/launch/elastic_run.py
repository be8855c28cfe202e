"""Run a training function under torch's elastic agent from a notebook or a script (no torchrun)."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from typing import Any, Optional

from lightning_dist.checks import check_choice, check_int
from lightning_dist.fork_safety import check_fork_safe

START_METHODS = ("fork", "spawn")
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def run_elastic(
    fn: Callable[..., Any],
    nproc: int = 2,
    *,
    max_restarts: int = 3,
    args: tuple[Any, ...] = (),
    start_method: Optional[str] = None,
) -> dict[int, Any]:
    """Start ``nproc`` workers running ``fn(*args)`` under torch's elastic agent on this machine and
    restart all of them (up to ``max_restarts`` times) when one fails, as ``torchrun --standalone``
    does; returns each rank's return value. With ``Elastic`` as the strategy inside ``fn``, a restart
    resumes from the newest commit.

    ``start_method``: "fork" (the default where available: works with functions defined in a
    notebook) or "spawn" (``fn`` and ``args`` must be picklable).
    """
    check_int("nproc", nproc, 1)
    check_int("max_restarts", max_restarts, 0)
    import multiprocessing

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if start_method is None:
        start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    check_choice("start_method", start_method, START_METHODS)
    # forked workers cannot use CUDA once this process initialised it: say so here, not in each worker
    check_fork_safe(start_method, "run_elastic")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"lightning_dist-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        start_method=start_method,
    )
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    try:
        return elastic_launch(config, fn)(*args)
    finally:  # the agent installs its own handlers in this process and leaves them behind
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
