"""Grammars and penalties through prefill -> kv_transfer -> decode over real gRPC, on the packaged SmolLM2.

The grammar's state crosses the handoff by replay: decode must continue the JSON exactly where
prefill's first token left it, so disaggregated output equals the colocated engine's token for
token, and the object parses against its schema.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from shared.engine.request import SamplingParams
from shared.structured.spec import GrammarSpec
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged, packaged_engine
from tests.integration.services.test_disagg_grpc import MODEL, Stack, run

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                   "population_millions": {"type": "number"}},
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


def test_constrained_and_penalized_output_crosses_the_handoff_unchanged() -> None:
    tok = packaged(MODEL).tokenizer
    prompts = [encode_prompt(tok, q, chat=True) for q in (
        "Give the capital of France as JSON.", "Describe Tokyo as JSON.", "List some fruit.")]
    params = [
        SamplingParams(max_tokens=64, temperature=0.0, structured=GrammarSpec("json_schema", json.dumps(SCHEMA))),
        SamplingParams(max_tokens=48, temperature=0.7, seed=5, structured=GrammarSpec("json_object")),
        SamplingParams(max_tokens=32, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                       logit_bias=((tok.convert_tokens_to_ids("Apple"), 5.0),)),
    ]
    expected = packaged_engine(MODEL, max_model_len=1024).generate(prompts, params)

    async def body(stack: Stack) -> list[tuple[list[int], str]]:
        got = await asyncio.gather(*(stack.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
        await asyncio.sleep(0.2)
        assert stack.engines_idle() and stack.kv.store.active_leases == 0
        return got

    got = run(body)
    assert [tokens for tokens, _ in got] == [r.token_ids for r in expected]
    answer = json.loads(tok.decode(got[0][0], skip_special_tokens=True))
    jsonschema.validate(answer, SCHEMA)
    assert got[0][1] == "stop"


def test_n_choices_share_one_prefill_and_one_handoff() -> None:
    from services.router.backend import BackendRequest
    from services.router.grpc_backend import GrpcBackend
    from tests.integration.services.test_disagg_grpc import backend_for

    tok = packaged(MODEL).tokenizer
    prompt = encode_prompt(tok, "Write a short poem about the sea.", chat=True)
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=11, n=3, logprobs=0)
    expected = packaged_engine(MODEL, max_model_len=1024).generate([prompt], params)

    async def body(stack: Stack) -> dict[int, list[int]]:
        backend: GrpcBackend = await backend_for(stack)
        tokens: dict[int, list[int]] = {}
        finished: dict[int, str | None] = {}
        async for chunk in backend.generate(BackendRequest("n3", prompt, params)):
            tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
            assert len(chunk.logprobs) == len(chunk.token_ids)
            if chunk.finished:
                finished[chunk.index] = chunk.finish_reason
        assert sorted(finished) == [0, 1, 2]
        # prompt logprobs come from prefill, on the first chunk
        first = [c async for c in backend.generate(BackendRequest("plp", prompt, SamplingParams(
            max_tokens=2, temperature=0.0, prompt_logprobs=1)))][0]
        assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
        assert [lp.token_id for lp in first.prompt_logprobs[1:] if lp is not None] == prompt[1:]
        # every choice ends at its first token: decode claims the handoff, pulls nothing, releases it
        ends = [c.finish_reason async for c in backend.generate(
            BackendRequest("n2-one", prompt, SamplingParams(max_tokens=1, n=2))) if c.finished]
        assert ends == ["length", "length"]
        await backend.close()
        await asyncio.sleep(0.2)
        assert stack.engines_idle() and stack.kv.store.active_leases == 0
        return tokens

    got = run(body)
    assert [got[i] for i in range(3)] == [r.token_ids for r in expected]
    assert len({tuple(t) for t in got.values()}) == 3  # three different samples
