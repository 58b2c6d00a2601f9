"""Disaggregated output equals colocated in every precision: prefill -> kv_transfer -> decode over real gRPC
(bf16 weights and KV cache, whose handoff moves bf16 blocks; int8 per channel; the GGUF's own blocks; int8 with
an fp8 KV cache, a byte a value in the handoff) against
one engine with the same settings, on the packaged SmolLM2."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged
from tests.integration.services.test_disagg_grpc import ENGINE, MODEL, QUESTIONS, Stack

pytestmark = pytest.mark.slow

PRECISIONS = {"bfloat16": dict(dtype="bfloat16"), "int8": dict(quantization="int8"),
              "gguf": dict(quantization="gguf"), "int8-fp8-kv": dict(quantization="int8", kv_cache_dtype="fp8")}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_disaggregated_equals_colocated(precision: str) -> None:
    settings: dict[str, Any] = PRECISIONS[precision]
    tok = packaged(MODEL).tokenizer
    prompts = [encode_prompt(tok, q, chat=True) for q in QUESTIONS]
    params = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=1, temperature=0.0),
              SamplingParams(max_tokens=20, temperature=0.8, seed=42), SamplingParams(max_tokens=16, temperature=0.0)]
    engine = LLMEngine(EngineConfig(model=MODEL, max_model_len=1024, kv_cache_bytes=64 << 20, **settings))
    assert engine.loaded.model.weight_format == EngineConfig(model=MODEL, **settings).weight_format
    expected = engine.generate(prompts, params)

    async def main() -> list[tuple[list[int], str]]:
        kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
        prefill = await start_prefill(PrefillSettings(**ENGINE, **settings))
        decode = await start_decode(DecodeSettings(**ENGINE, **settings))
        stack = Stack(kv, prefill, decode)
        try:
            got = await asyncio.gather(*(stack.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
            await asyncio.sleep(0.2)
            assert stack.engines_idle()
            assert kv.store.active_leases == 0
            return got
        finally:
            for s in (decode, prefill, kv):
                await s.stop()

    got = asyncio.run(main())
    for (tokens, finish), exp in zip(got, expected, strict=True):
        assert tokens == exp.token_ids
        assert finish == exp.finish_reason
