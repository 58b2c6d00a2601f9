"""Pytest fixtures any test directory can use by importing them into its conftest.py:

    from tests.helpers.fixtures import redis_url, require_redis_server  # noqa: F401

`redis_url` is one real redis-server for the whole session; give each test its own namespace (or
key prefix) rather than flushing. Without `redis-server` installed the tests using it are skipped,
except under CI (env var CI set), where they fail: CI must run them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.redis_server import INSTALL_HINT, REDIS_SERVER, redis_server_path, start_redis, stop_redis


def ensure_redis_server() -> None:
    """Fail the calling test when redis-server is missing: `make test` installs it (system-deps), so its
    absence is a broken setup, never a reason to skip."""
    if redis_server_path() is None:
        pytest.fail(f"{REDIS_SERVER} not found on PATH; {INSTALL_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def require_redis_server() -> None:
    """Depend on this in tests that start their own redis-server (e.g. to kill and restart it)."""
    ensure_redis_server()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real redis-server on 127.0.0.1, started once per session and stopped at its end."""
    ensure_redis_server()
    proc, url = start_redis()
    try:
        yield url
    finally:
        stop_redis(proc)
