"""Pytest fixtures any test directory can use by importing them into its conftest.py:

    from tests.helpers.fixtures import redis_url, require_redis_server  # noqa: F401

`redis_url` is one real redis-server for the whole session; give each test its own namespace (or
key prefix) rather than flushing. Without `redis-server` installed the tests using it are skipped,
except under CI (env var CI set), where they fail: CI must run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers.redis_server import INSTALL_HINT, REDIS_SERVER, redis_server_path, start_redis, stop_redis


def ensure_redis_server() -> None:
    """Skip the calling test when redis-server is missing, or fail it when the env var CI is set."""
    if redis_server_path() is not None:
        return
    message = f"{REDIS_SERVER} not found on PATH; {INSTALL_HINT}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set, so this is a failure, not a skip)", pytrace=False)
    pytest.skip(message)


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
