"""Fork launches after CUDA: a clear error in the parent, naming the call that initialised CUDA.

In a notebook ``DDP()`` (and every strategy built on it) starts its ranks with ``fork``: the children
are copies of the kernel, so they see everything defined in it. A process that has initialised CUDA
cannot be forked for GPU work: the children fail with torch's "Cannot re-initialize CUDA in forked
subprocess", raised inside each child, far from the cause. Lightning's own check
(``_check_bad_cuda_fork``) only looks at whether the *current* process is a bad fork, so it does not
stop the parent. ``check_fork_safe`` does, in the parent, before anything is forked (the strategies'
launcher, ``lightning_dist.strategies.fork_launcher``, and ``run_elastic`` call it).

``trace_cuda_init`` (installed on ``import lightning_dist`` where CUDA is available) records the stack
of the call that first initialises CUDA in this process, so the error can name it. Needs torch only.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Optional

import torch

_first_cuda_init: list[str] = []
"""The stack of the call that first initialised CUDA in this process (``trace_cuda_init``)."""


CUDA_INIT_HOLDERS = ("torch.cuda", "torch.cuda.random", "torch.cuda.memory")
"""The modules that hold ``_lazy_init`` under their own name: ``torch.cuda.random`` and
``torch.cuda.memory`` import it by name (``from . import _lazy_init``), so ``get_rng_state(_all)``,
``fork_rng()``, ``initial_seed()`` and the memory caps call their copy, not ``torch.cuda._lazy_init``."""


def trace_cuda_init() -> bool:
    """Record where CUDA is first initialised in this process (``first_cuda_init``): wraps
    ``_lazy_init``, which every CUDA entry point calls before using the device, in each module of
    ``CUDA_INIT_HOLDERS`` that holds it. Returns whether the tracer is in place (False where CUDA is
    not available or already initialised)."""
    cuda = torch.cuda
    original: Callable[[], None] = cuda._lazy_init
    if getattr(original, "traced_by_lightning_dist", False):
        _install(original, getattr(original, "wraps_lazy_init", None))
        return True
    if not cuda.is_available() or cuda.is_initialized():
        return False

    def traced_lazy_init() -> None:
        if not _first_cuda_init and not cuda.is_initialized():
            _first_cuda_init.append("".join(traceback.format_stack(limit=14)[:-1]))
        original()

    traced_lazy_init.traced_by_lightning_dist = True  # type: ignore[attr-defined]
    traced_lazy_init.wraps_lazy_init = original  # type: ignore[attr-defined]
    _install(traced_lazy_init, original)
    return True


def _install(traced: Callable[[], None], original: Optional[Callable[[], None]]) -> None:
    """Put ``traced`` in place of ``original`` in every loaded module of ``CUDA_INIT_HOLDERS``."""
    for name in CUDA_INIT_HOLDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_lazy_init", None) in (original, traced):
            module._lazy_init = traced  # type: ignore[attr-defined]


def first_cuda_init() -> Optional[str]:
    """Where CUDA was first initialised in this process, as a stack, when ``trace_cuda_init`` saw it."""
    return _first_cuda_init[0] if _first_cuda_init else None


def fork_unsafe_message(start_method: str, owner: str) -> str:
    """What ``check_fork_safe`` raises: the problem, the call that initialised CUDA when traced, the fixes."""
    where = first_cuda_init()
    seen = f" It was first initialised by this call:\n{where}" if where else ""
    return (
        f"{owner}: CUDA was initialised in this process before a fork launch (start_method="
        f"{start_method!r}); the forked ranks could not use the GPUs (CUDA cannot be re-initialised in a "
        "forked process). Something ran CUDA before fit: a model or tensor moved to a GPU, a call such as "
        "torch.cuda.current_device(), get_device_name(), synchronize() or memory_allocated(), a read of "
        "the GPUs' random state (torch.random.fork_rng(), torch.cuda.get_rng_state() or "
        "get_rng_state_all(), initial_seed(); a library that forks the RNG does it too), or an earlier "
        "GPU run in this process. To fix it: in a notebook, restart the kernel and run nothing "
        "that uses CUDA before trainer.fit (torch.cuda.device_count() and torch.cuda.is_available() are "
        "fine; let Lightning move the model to the GPUs inside the ranks); from a script, use "
        "start_method='popen' (the default outside notebooks; strategy='ld_ddp_popen') or "
        "start_method='spawn' ('ld_ddp_spawn'), which start fresh processes." + seen
    )


def check_fork_safe(start_method: str, owner: str, *, uses_cuda: bool = True) -> None:
    """Raise ``RuntimeError`` naming the problem and the fixes when a ``fork`` launch of ranks that use
    CUDA (``uses_cuda``) would follow CUDA's initialisation in this process.

    ``owner`` names the strategy in the message. Other start methods ("popen", "spawn", "forkserver")
    start fresh interpreters and pass, as does a launch whose ranks run on CPU only.
    """
    if start_method != "fork" or not uses_cuda:
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(fork_unsafe_message(start_method, owner))
