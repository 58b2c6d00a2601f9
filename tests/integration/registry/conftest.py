"""Registry integration tests run against a real redis-server (one per session, see tests/helpers)."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers.fixtures import redis_url, require_redis_server  # noqa: F401  (re-exported fixtures)


@pytest.fixture
def namespace() -> str:
    """A namespace of its own per test, so tests sharing the server never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:12]}"
