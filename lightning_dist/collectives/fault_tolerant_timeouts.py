"""``FaultTolerant``'s timeouts, derived from one figure: ``peer_timeout_s``, how long a peer may be
silent (a slow step, a stopped process, a lost link) before the others go on without it.

A peer whose process *dies* is not waited for at all: its sockets close, so an in-flight Gloo
collective fails at once, and its heartbeats to the Lighthouse stop, so the Lighthouse drops it
after its heartbeat timeout (the launcher's ``--heartbeat-timeout-ms``, ``HEARTBEAT_TIMEOUT_MS``;
each Manager heartbeats every ``HEARTBEAT_INTERVAL_S``). ``peer_timeout_s`` only bounds a peer that is
alive but silent (SIGSTOP, a hang), which no socket or heartbeat can tell from a slow one.

The rules (``derive_timeouts``), one place:

- collectives (the reconfigurable process group) wait ``peer_timeout_s`` for a silent peer;
- a step's other waits (torchft's Manager ``timeout``: the commit vote, a wrapped future, the
  checkpoint transfer to or from a peer) ``peer_timeout_s`` too;
- a quorum waits ``peer_timeout_s``: a group finishing its step may be held that long by a silent peer;
- start-up: the Lighthouse must answer within ``peer_timeout_s``, and a fresh run's first step waits
  up to the quorum timeout for ``start_groups`` groups;
- a replica group's own process group (several processes per group) waits two collective timeouts
  and a quorum: how far its processes may drift apart while one of them waits on a silent peer.

``timeout_s`` (collectives, step and start-up) and ``quorum_timeout_s`` given explicitly override
the figure they name; the others still follow ``peer_timeout_s``. With neither given and
``peer_timeout_s=60`` (the default) every figure is what it was before the option existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

HEARTBEAT_INTERVAL_S = 0.05
"""How often each group's Manager tells the Lighthouse it is alive (torchft's default: 0.1 s)."""
HEARTBEAT_TIMEOUT_MS = 500
"""The Lighthouse's heartbeat timeout the pack's launcher uses by default (torchft's: 5000 ms): a
dead group is out of the next quorum this long after its process died (10 missed heartbeats)."""


@dataclass(frozen=True)
class FaultTolerantTimeouts:
    """The timeouts one ``peer_timeout_s`` gives (module docstring); seconds."""

    peer_s: float
    """The figure they come from."""
    collective_s: float
    """A collective on the reconfigurable process group waiting for a silent peer."""
    step_s: float
    """The Manager's other waits in a step: the commit vote, a wrapped future, a checkpoint transfer."""
    quorum_s: float
    """A quorum forming (also how long a fresh run's first step waits for ``start_groups``)."""
    startup_s: float
    """The Lighthouse answering at setup."""
    group_s: float
    """The replica group's own process group (several processes per group)."""
    overridden: tuple[str, ...] = ()
    """The options given explicitly (``timeout_s``, ``quorum_timeout_s``)."""

    def line(self) -> str:
        """The one line a group's rank 0 prints at start."""
        given = f" ({', '.join(self.overridden)} given)" if self.overridden else ""
        return (
            f"FaultTolerant: timeouts from peer_timeout_s={self.peer_s:g}{given}: collectives "
            f"{self.collective_s:g} s, step {self.step_s:g} s, quorum {self.quorum_s:g} s, start-up "
            f"{self.startup_s:g} s, in-group {self.group_s:g} s; a dead group is dropped by the "
            f"Lighthouse's heartbeat timeout (heartbeats every {HEARTBEAT_INTERVAL_S:g} s)"
        )


def derive_timeouts(
    peer_timeout_s: float, timeout_s: Optional[float] = None, quorum_timeout_s: Optional[float] = None
) -> FaultTolerantTimeouts:
    """Every timeout of a ``FaultTolerant`` run from ``peer_timeout_s`` (module docstring's rules);
    ``timeout_s``/``quorum_timeout_s``, when given, override what they name."""
    collective = peer_timeout_s if timeout_s is None else timeout_s
    quorum = peer_timeout_s if quorum_timeout_s is None else quorum_timeout_s
    overridden = tuple(
        name
        for name, value in (("timeout_s", timeout_s), ("quorum_timeout_s", quorum_timeout_s))
        if value is not None
    )
    return FaultTolerantTimeouts(
        peer_s=peer_timeout_s,
        collective_s=collective,
        step_s=collective,
        quorum_s=quorum,
        startup_s=collective,
        group_s=2 * collective + quorum,
        overridden=overridden,
    )
