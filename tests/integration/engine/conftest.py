"""Engine fixtures: every engine a test makes is checked for leaked KV blocks afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shared.engine.engine import LLMEngine
from tests.helpers.models import packaged_engine, tiny_engine, tiny_loaded


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()
        engine.check_no_leaks()


@pytest.fixture
def make_tiny(engines: list[LLMEngine]) -> Callable[..., tuple[LLMEngine, Any]]:
    def make(family: str = "llama", seed: int = 0, **config: Any) -> tuple[LLMEngine, Any]:
        loaded, hf = tiny_loaded(family, seed)
        engine = tiny_engine(loaded, **config)
        engines.append(engine)
        return engine, hf

    return make


@pytest.fixture
def make_packaged(engines: list[LLMEngine]) -> Callable[..., LLMEngine]:
    def make(name: str, serving: bool = False, **config: Any) -> LLMEngine:
        engine = packaged_engine(name, serving, **config)
        engines.append(engine)
        return engine

    return make
