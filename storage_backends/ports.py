"""Loopback ports for the servers a test or the demo starts (moto, NATS, ZMQ endpoints).

A port taken with ``bind(0)`` comes from the kernel's ephemeral range, which the kernel also hands
to every outgoing connection. Between "free now" and the server's own ``bind`` (an engine takes
~25 s to start), any connect() on the host may take that port, and the server then fails with
"Address already in use". Ports below the ephemeral range are never auto-assigned, so only an
explicit bind can collide with them: :func:`free_port` picks there, at random, and checks it.
"""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

__all__ = ["free_port"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below this sit well-known service ports (e.g. NATS 4222, Redis 6379)
_TRIES = 200
_RECENT: deque[int] = deque(maxlen=4096)  # handed out lately: the caller may not have bound it yet


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768), or 32768."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """Return a TCP port on ``host`` that is free now, with the next ``count - 1`` ports free too.

    Args:
        host: the address the caller will bind.
        count: how many consecutive ports are wanted (vLLM's replay socket sits at PORT + 1).

    Returns:
        The first port of the run, chosen at random below the ephemeral range when that range
        leaves room (see the module docstring) and not handed out by this process lately (two
        calls before either bind never get the same port); otherwise one the kernel picks
        (``bind(0)``), for which ``count`` must be 1.

    Raises:
        OSError: no such run was found after a bounded number of tries.
    """
    top = _ephemeral_low() - count
    if top > _LOWEST:
        for _ in range(_TRIES):
            port = random.randint(_LOWEST, top)
            run = range(port, port + count)
            if not any(p in _RECENT for p in run) and all(_bindable(host, p) for p in run):
                _RECENT.extend(run)
                return port
    if count == 1:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    raise OSError(f"no {count} consecutive free ports on {host}")
