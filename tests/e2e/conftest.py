"""End-to-end fixtures: `baton up` stacks as real processes, registered in a real Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.fixtures import redis_url  # noqa: F401  (session fixture)
from tests.helpers.stack import BatonStack, start_stack

MODEL_ARGS = ("--model", "smollm2-135m", "--max-model-len", "1024", "--kv-cache-bytes", str(96 << 20))


@pytest.fixture(scope="module")
def disagg_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatonStack]:  # noqa: F811
    stack = start_stack(tmp_path_factory.mktemp("disagg"), *MODEL_ARGS, "--prefill", "2", "--decode", "1",
                        "--redis-url", redis_url, "--api-key", "test-key")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def colocated_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatonStack]:
    """No --redis-url: the router's in-process registry polls the addresses baton up gives it."""
    stack = start_stack(tmp_path_factory.mktemp("colocated"), *MODEL_ARGS, "--mode", "colocated")
    yield stack
    stack.stop()
