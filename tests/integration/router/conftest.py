"""Router test fixtures: real engines (SmolLM2, and a tiny random Llama sharing SmolLM2's tokenizer),
one per module, each behind an EngineBackend and checked for leaked KV blocks when the module ends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.models import packaged, packaged_engine, tiny_engine, tiny_loaded
from tests.integration.router.helpers import SMOL, EngineUnderTest, engine_under_test


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol_tokenizer() -> Any:
    return packaged(SMOL).tokenizer


@pytest.fixture(scope="module")
def smol() -> Iterator[EngineUnderTest]:
    with engine_under_test(packaged_engine(SMOL, max_model_len=1024, kv_cache_bytes=64 << 20)) as under_test:
        yield under_test


@pytest.fixture(scope="module")
def tiny(smol_tokenizer: Any) -> Iterator[EngineUnderTest]:
    loaded, _ = tiny_loaded("llama", vocab_size=len(smol_tokenizer), max_position_embeddings=512)
    loaded.tokenizer = smol_tokenizer
    with engine_under_test(tiny_engine(loaded, max_model_len=512)) as under_test:
        yield under_test
