"""Free TCP ports for the listeners foretoken starts itself (demo, tests, benchmarks).

Linux hands outgoing connections ports from its ephemeral range (32768–60999 by default):
a listener port picked there ("bind to 0") can be taken by some client's connection a moment
later, before the listener binds it. Listeners therefore pick below that range.
"""

from __future__ import annotations

import random
import socket
from typing import Final

LISTENER_PORTS: Final = (20000, 32000)  # below the ephemeral range
ATTEMPTS: Final = 500
_rng = random.SystemRandom()


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port P with P … P+count−1 all free on ``host`` (e.g. a broker and its controller
    on P + 1), below the ephemeral range."""
    low, high = LISTENER_PORTS
    for _ in range(ATTEMPTS):
        base = _rng.randrange(low, high - count)
        if all(_bindable(host, base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} adjacent free port(s) in {low}–{high} on {host}")


def in_use(host: str, port: int) -> bool:
    """Whether something accepts connections on ``host:port``."""
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


def host_port(bootstrap: str) -> tuple[str, int]:
    first = bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    return (host or "127.0.0.1"), int(port)


def accepts_connections(bootstrap: str, timeout_s: float = 0.5) -> bool:
    host, port = host_port(bootstrap)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
