"""How much torchft says. Quiet by default: its servers (the Lighthouse and each group's Manager,
written in Rust) log every quorum at INFO, thousands of lines for a short run in which a traceback
is hard to find; here they log warnings and errors only, and torchft's Python loggers warnings and
up, less the "NCCL flight recorder" warning that CPU builds of torch print at every new quorum and
the traceback of each peer failure its Manager records (the pack's own line says it:
``fault_tolerant_events``).

One switch turns everything back on: ``LD_FT_VERBOSE=1`` in the environment (the launcher's
``--verbose`` sets it for its Lighthouse and groups), or ``FaultTolerant(verbose=True)``. The Rust
servers read their level (``RUST_LOG``) once, when torchft is first imported in a process: the
launcher sets it before its Lighthouse and its groups' standbys start, and the strategy sets it when
torchft is not imported yet. A ``RUST_LOG`` the user sets is left alone.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Optional

VERBOSE_ENV = "LD_FT_VERBOSE"
"""``1`` (or ``true``/``yes``): torchft's INFO logs, from its Rust servers and its Python loggers."""
RUST_LOG_ENV = "RUST_LOG"
QUIET_RUST_LOG = "warn"
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
"""torchft's Python loggers (``torchft.*`` and the three structured ones its Manager writes)."""
FLIGHT_RECORDER = "flight recorder"
SWALLOWED = "got exception"
"""How torchft's Manager starts the line (with a traceback) of an error it records and goes on from."""


def verbose_wanted(verbose: Optional[bool] = None, env: Optional[MutableMapping[str, str]] = None) -> bool:
    """``verbose`` when given, else whether ``$LD_FT_VERBOSE`` says so."""
    if verbose is not None:
        return verbose
    value = (os.environ if env is None else env).get(VERBOSE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def quiet_servers(env: MutableMapping[str, str], verbose: bool) -> None:
    """Set ``env``'s ``RUST_LOG`` for torchft's servers: warnings and errors only unless ``verbose``
    (a value already there is kept)."""
    if not verbose:
        env.setdefault(RUST_LOG_ENV, QUIET_RUST_LOG)


class _NoFlightRecorder(logging.Filter):
    """Drops torchft's "Unable to reset NCCL flight recorder" warning (torch builds without NCCL) and
    the traceback its Manager logs for each error it swallows and records ("got exception ...": the
    step is then not committed): the pack writes one line per failure instead, with its cause
    (``fault_tolerant_events``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return FLIGHT_RECORDER not in message and SWALLOWED not in message


_FILTER = _NoFlightRecorder()
_HANDLER = logging.StreamHandler(sys.stderr)
_HANDLER.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] [%(name)s] %(message)s"))


def configure_torchft_logs(verbose: bool) -> None:
    """torchft's logs in this process as the module docstring says: call it before torchft is first
    imported, so its Rust servers see ``RUST_LOG`` too. A Python logger whose level the user set is
    left at it."""
    if "torchft" not in sys.modules:
        quiet_servers(os.environ, verbose)
    manager = logging.getLogger("torchft.manager")
    for name in TORCHFT_LOGGERS:
        log = logging.getLogger(name)
        if verbose:
            log.setLevel(logging.INFO)
            if not log.handlers and not logging.getLogger().handlers:
                log.addHandler(_HANDLER)
        elif log.level == logging.NOTSET:
            log.setLevel(logging.WARNING)
    if verbose:
        manager.removeFilter(_FILTER)
    else:
        manager.addFilter(_FILTER)
