"""A decode that runs out of blocks parks its preempted contexts in kv_transfer's pool and reads them back when
they resume (shared/engine/kv_spill.py): real kv_transfer, prefill and decode over gRPC in one process, the
packaged SmolLM2. Greedy tokens equal a colocated engine that never preempts; nothing leaks on either side."""

from __future__ import annotations

import asyncio

import pytest

from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from shared.engine.request import SamplingParams
from shared.service.engine_metrics import EngineCollector
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged, packaged_engine
from tests.integration.services.test_disagg_grpc import ENGINE, MODEL, Stack

pytestmark = pytest.mark.slow

STORIES = ["Tell me a long story about dragons.", "Describe a walk through a forest in autumn.",
           "Explain how a steam engine works, step by step.", "Write a letter to a friend about the sea.",
           "What would a city on Mars need first?", "Teach me to bake bread."]
# 9 blocks of 16 tokens: six ~110-token requests take turns (preemption), and the one running evicts the
# blocks a preempted one left cached, so its context has to come back from kv_transfer
DECODE = dict(ENGINE, num_kv_blocks=9, max_model_len=144)


def test_preempted_contexts_swap_back_in_from_kv_transfer() -> None:
    tok = packaged(MODEL).tokenizer
    prompts = [encode_prompt(tok, q, chat=True) for q in STORIES]
    params = SamplingParams(max_tokens=72, min_tokens=72, temperature=0.0)
    expected = [r.token_ids for r in packaged_engine(MODEL, max_model_len=1024).generate(prompts, [params] * len(prompts))]

    async def body() -> list[tuple[list[int], str]]:
        kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
        prefill = await start_prefill(PrefillSettings(**ENGINE))
        decode = await start_decode(DecodeSettings(**DECODE, kv_spill=True))
        stack = Stack(kv, prefill, decode)
        try:
            got = await asyncio.gather(*(stack.generate(p, params) for p in prompts))
            engine = decode.host.aengine.engine
            assert engine.scheduler.num_preemptions_total > 0
            assert engine.spill is not None and engine.remote is not None
            stats = engine.remote.stats.by_direction
            # every preemption parked its context (the prompts' blocks were in the pool already: only the
            # generated ones were written), and resumes read blocks back instead of recomputing them
            assert stats["spill"].count > 0 and stats["spill"].failures == 0 and engine.spill.spilled_units > 0
            assert stats["swap_in"].count > 0 and stats["swap_in"].failures == 0
            assert engine.spill.swapped_in_blocks > 0 and len(engine.spill.recent_swap_in_s) == stats["swap_in"].count
            # exported: the swap-in histogram under tier="kv_transfer", the parked and restored block counters
            metrics = {m.name: m for m in EngineCollector(decode.host.aengine, "decode").collect()}
            swap = {s.labels.get("tier"): s.value for s in metrics["baton_kv_swap_in_seconds"].samples
                    if s.name == "baton_kv_swap_in_seconds_count"}
            assert swap == {"kv_transfer": stats["swap_in"].count}
            assert metrics["baton_kv_spill_parked_blocks"].samples[0].value == engine.spill.spilled_units
            assert metrics["baton_kv_spill_restored_blocks"].samples[0].value == engine.spill.swapped_in_blocks
            await asyncio.sleep(0.2)
            assert stack.engines_idle() and kv.store.active_leases == 0
            return got
        finally:
            for s in (decode, prefill, kv):
                await s.stop()

    got = asyncio.run(body())
    assert [tokens for tokens, _ in got] == expected
