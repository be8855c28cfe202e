"""The addresses a replica group of a torchft job is given, checked before anything connects: the
Lighthouse URL, the group's id and the address its servers listen on; and whether the Lighthouse
answers at all, within a bound (torchft's own client retries a bad address for a minute or more)."""

from __future__ import annotations

import socket
import time
from typing import Any, Optional
from urllib.parse import urlsplit

LIGHTHOUSE_FORM = "'http://host:port' (e.g. http://127.0.0.1:29510)"


def check_lighthouse(value: Any, name: str = "lighthouse", *, owner: str = "FaultTolerant") -> str:
    """``value`` when it is a Lighthouse address ``http(s)://host:port``; ``TypeError`` (not a str)
    or ``ValueError`` (another form) naming ``name`` and the accepted form."""
    if not isinstance(value, str):
        raise TypeError(f"{owner}: {name}={value!r}; accepted: a str {LIGHTHOUSE_FORM}")
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or not port
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(f"{owner}: {name}={value!r}; accepted: {LIGHTHOUSE_FORM}")
    return value


def check_replica_id(value: Any, *, owner: str = "FaultTolerant") -> Optional[str]:
    """``value`` as torchft takes a replica group's id (a str; an int becomes its digits); None stays
    None. torchft appends ``:<uuid>`` to it and reads the trailing digits as the group's number, so
    an empty id or one with ``:`` is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(
            f"{owner}: replica_id={value!r}; accepted: None, an int or a str without ':' (e.g. 0 or 'group0')"
        )
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{owner}: replica_id={value!r}; accepted: an int >= 0, or a str without ':'")
    text = str(value)
    if not text.strip() or ":" in text or text != text.strip():
        raise ValueError(
            f"{owner}: replica_id={value!r}; accepted: a non-empty str without ':' or spaces around it "
            "(torchft appends ':<uuid>'), or an int"
        )
    return text


def check_host(value: Any, *, owner: str = "FaultTolerant") -> Optional[str]:
    """``value`` when it is an address to listen on (a host name or IP, no scheme, port or spaces);
    None stays None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{owner}: host={value!r}; accepted: None or a str (this machine's address)")
    if not value or any(c.isspace() for c in value) or "/" in value:
        raise ValueError(
            f"{owner}: host={value!r}; accepted: None (${'{'}LD_FT_HOST{'}'} or 127.0.0.1) or an address "
            "to listen on, such as '10.0.0.5' or 'node1' (no scheme, no port)"
        )
    return value


def wait_for_lighthouse(url: str, timeout_s: float, *, owner: str = "FaultTolerant") -> None:
    """Return once a TCP connection to the Lighthouse at ``url`` opens, retrying for ``timeout_s``
    (it may be starting); ``ConnectionError`` naming the address when its host does not resolve or
    nothing answers in time."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", int(parts.port or 0)
    deadline = time.monotonic() + timeout_s
    advice = (
        "start one (python -m lightning_dist.launch.fault_tolerant starts it and sets $TORCHFT_LIGHTHOUSE; "
        "on a cluster: torchft_lighthouse --bind host:port) or pass its address (lighthouse=)"
    )
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(left, 2.0))):
                return
        except socket.gaierror as err:
            raise ConnectionError(
                f"{owner}: the Lighthouse address {url} names a host that does not resolve ({err}); {advice}"
            ) from err
        except OSError as err:
            if time.monotonic() + 0.2 >= deadline:
                raise ConnectionError(
                    f"{owner}: no Lighthouse answers at {url} (tried for timeout_s={timeout_s} s: {err}); "
                    f"{advice}"
                ) from err
        time.sleep(0.2)
