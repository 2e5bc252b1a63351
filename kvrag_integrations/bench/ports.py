"""Loopback ports for the throwaway servers the benches and tests start.

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, the same
range it draws every outgoing connection's local port from: between choosing such
a port and a server binding it (or while a killed node is down), any client on the
machine can take it, and the server dies with "Address already in use". So a
server's port is drawn from below that range, where only listeners bind.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FALLBACK_EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
_LOWEST = 10000  # below: well-known and registered services' ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default
    where /proc does not say)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _FALLBACK_EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` nothing listens on now, outside the ephemeral range.

    Drawn at random, so servers started at once by parallel processes rarely draw
    the same one; where the range below the ephemeral one is too small, the
    kernel's choice is the fallback.
    """
    low, _ = ephemeral_range()
    if low - _LOWEST >= 1000:
        for _ in range(100):
            port = random.randrange(_LOWEST, low)
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
