"""The router's key ring (file keys, rotation) and per-key limits, on a fake clock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.router.auth import KeyLimits, KeyRing, key_id
from shared.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_keys_come_from_settings_and_a_file_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team a\nalpha\n\n  beta  \n")
    clock = Clock()
    ring = KeyRing(["fixed"], path, clock)
    assert [ring.match(k) for k in (b"alpha", b"beta", b"fixed", b"gamma", b"")] == [b"alpha", b"beta", b"fixed",
                                                                                      None, None]
    path.write_text("gamma\n")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert ring.match(b"alpha") == b"alpha"  # checked at most once a second
    clock.now += 1.5
    assert ring.match(b"alpha") is None and ring.match(b"gamma") == b"gamma" and ring.match(b"fixed") == b"fixed"
    path.unlink()  # a file gone later keeps the last keys (logged), rather than locking everyone out
    clock.now += 1.5
    assert ring.match(b"gamma") == b"gamma"


def test_a_missing_keys_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the API keys file"):
        KeyRing([], tmp_path / "absent")


def test_no_keys_no_file_means_open() -> None:
    assert not KeyRing([]).enabled and KeyRing(["k"]).enabled


def test_concurrency_limit_frees_on_release() -> None:
    limits = KeyLimits(max_concurrent=2)
    assert limits.acquire("a") is None and limits.acquire("a") is None
    assert limits.acquire("a") == 1.0
    assert limits.acquire("b") is None  # per key
    limits.release("a")
    assert limits.acquire("a") is None and limits.in_flight("a") == 2
    for _ in range(2):
        limits.release("a")
    with pytest.raises(AssertionError, match="did not hold"):
        limits.release("a")


def test_rate_limit_is_a_bucket_of_a_minutes_worth() -> None:
    clock = Clock()
    limits = KeyLimits(requests_per_minute=3, clock=clock)
    for _ in range(3):
        assert limits.acquire("a") is None
        limits.release("a")
    wait_s = limits.acquire("a")
    assert wait_s == pytest.approx(20.0)  # one token every 20 s
    clock.now += 10
    assert limits.acquire("a") == pytest.approx(10.0)
    clock.now += 10
    assert limits.acquire("a") is None


def test_key_ids_hide_the_key() -> None:
    assert key_id(b"secret-key") == key_id(b"secret-key") != key_id(b"secret-kez")
    assert "secret" not in key_id(b"secret-key")
