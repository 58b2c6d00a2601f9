"""Ports for services a launcher starts: free now, and outside the kernel's ephemeral range.

A port picked by binding to 0 comes from the ephemeral range, where every outgoing connection and every
listener bound to port 0 (gRPC channels, a transport agent's UCX or TCP listener) also takes its port: in
the seconds between the pick and the child's own bind, one of them can take it ("Address already in
use", a stack that never comes up). Picking below that range leaves only other launchers to race with.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Set as AbstractSet
from pathlib import Path

LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below: the well-known and registered ports services are often configured on
_TRIES = 200


def ephemeral_range(path: Path = LOCAL_PORT_RANGE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last); Linux's default when it cannot be read."""
    try:
        first, last = (int(v) for v in path.read_text().split())
        return first, last
    except (OSError, ValueError):
        return 32_768, 60_999


def unused_port(host: str = "127.0.0.1", rng: random.Random | None = None,
                ephemeral: tuple[int, int] | None = None, avoid: AbstractSet[int] = frozenset()) -> int:
    """A TCP port free on `host` now, below the ephemeral range when there is room there (else any), and not
    in `avoid`: ports a launcher has already given out but whose owners have not bound them yet."""
    first, _ = ephemeral or ephemeral_range()
    rng = rng or random.Random()
    if first - _LOWEST >= 1_000:
        for _ in range(_TRIES):
            port = rng.randrange(_LOWEST, first)
            if port not in avoid and _bindable(host, port):
                return port
    for _ in range(_TRIES):  # a crowded host: any free port the kernel gives, but none given out already
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError(f"no free TCP port on {host} outside the {len(avoid)} already given out")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
