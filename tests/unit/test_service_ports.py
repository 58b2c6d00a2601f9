"""Ports a launcher hands its children: free, and below the kernel's ephemeral range (where outgoing
connections and port-0 listeners could take them between the pick and the child's bind)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from shared.service.ports import ephemeral_range, unused_port


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    first, last = ephemeral_range()
    assert 1024 < first < last
    for seed in range(20):
        port = unused_port(rng=random.Random(seed))
        assert port < first
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: raises if not


def test_a_taken_port_is_skipped() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", unused_port(rng=random.Random(1))))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        # the same draws as the taken port's: the first candidate is that port, so another must come
        assert unused_port(rng=random.Random(1)) != port
    finally:
        taken.close()


def test_no_room_below_the_range_falls_back_to_any_free_port(tmp_path: Path) -> None:
    assert unused_port(ephemeral=(10_500, 60_999)) >= 1024
    given: set[int] = set()
    for _ in range(5):  # the fallback too skips the ports already given out
        port = unused_port(ephemeral=(10_500, 60_999), avoid=given)
        assert port not in given
        given.add(port)
    bad = tmp_path / "range"
    bad.write_text("not numbers")
    assert ephemeral_range(bad) == (32_768, 60_999)
