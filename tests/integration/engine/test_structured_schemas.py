"""A property of structured outputs: for a few hundred JSON Schemas drawn at random
(tests/helpers/random_schemas.py), every constrained output, greedy and sampled hot, is a
document that validates against its schema. The tiny random model over the byte tokenizer
writes whatever its weights favour, so validity is the grammar's doing alone."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.structured.spec import GrammarSpec
from tests.helpers.models import tiny_engine, tiny_loaded_with_tokenizer
from tests.helpers.random_schemas import random_schemas
from tests.helpers.tokenizers import SPECIALS, byte_tokenizer

NUM_SCHEMAS = 300
BATCH = 50


def _text(token_ids: list[int]) -> str:
    return bytes(t - len(SPECIALS) for t in token_ids if t >= len(SPECIALS)).decode("utf-8", "surrogatepass")


def test_every_constrained_output_validates(engines: list[LLMEngine]) -> None:
    engine = tiny_engine(tiny_loaded_with_tokenizer("llama")[0], max_model_len=512)
    engines.append(engine)
    schemas = random_schemas(NUM_SCHEMAS, seed=22)
    prompt = list(byte_tokenizer()("Answer in JSON:", add_special_tokens=False).input_ids)
    checked = 0
    for start in range(0, NUM_SCHEMAS, BATCH):
        chunk = schemas[start:start + BATCH]
        params: list[Any] = []
        for i, schema in enumerate(chunk):
            spec = GrammarSpec("json_schema", json.dumps(schema))
            hot = (start + i) % 2 == 1  # every other one sampled at temperature 1.5
            params.append(SamplingParams(max_tokens=400, temperature=1.5 if hot else 0.0, seed=start + i,
                                         structured=spec))
        results = engine.generate([prompt] * len(chunk), params)
        for schema, result in zip(chunk, results, strict=True):
            text = _text(result.token_ids)
            assert result.finish_reason == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)
            checked += 1
    assert checked == NUM_SCHEMAS
