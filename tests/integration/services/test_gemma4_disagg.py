"""A tiny multimodal Gemma 4 checkpoint (MoE, K=V, KV-shared, PLE, double-wide) through prefill -> kv_transfer
-> decode over real gRPC in one process: greedy tokens equal to a colocated engine and to transformers, and only
the stored layers' KV crosses the wire."""

from __future__ import annotations

import asyncio
from pathlib import Path
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
from tests.helpers.gemma4 import hf_from_checkpoint, hf_greedy, tiny_gemma4_checkpoint
from tests.integration.services.test_disagg_grpc import Stack

pytestmark = pytest.mark.slow

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4") / "tiny")


def engine_settings(model: Path) -> dict[str, Any]:
    return dict(model=str(model), port=0, metrics_port=-1, kv_cache_bytes=16 << 20, max_model_len=512,
                kv_claim_wait_s=0.5)


def test_disaggregated_equals_colocated_and_transformers(checkpoint: Path) -> None:
    prompts = [list(range(100 * i + 10, 100 * i + 10 + n)) for i, n in enumerate((5, 23, 40))]  # 40: 5 windows
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0.0)
    colocated = LLMEngine(EngineConfig(model=str(checkpoint), max_model_len=512, kv_cache_bytes=16 << 20))
    expected = [r.token_ids for r in colocated.generate(prompts, params)]
    colocated.close()
    hf = hf_from_checkpoint(checkpoint)
    assert expected == [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]

    async def body() -> tuple[list[list[int]], int]:
        kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
        prefill = await start_prefill(PrefillSettings(**engine_settings(checkpoint)))
        decode = await start_decode(DecodeSettings(**engine_settings(checkpoint)))
        stack = Stack(kv, prefill, decode)
        try:
            got = [(await stack.generate(p, params))[0] for p in prompts]
            await asyncio.sleep(0.2)
            assert stack.engines_idle() and kv.store.active_leases == 0
            engine = prefill.host.aengine.engine
            return got, engine.remote.stats.by_direction["push"].nbytes
        finally:
            for s in (decode, prefill, kv):
                await s.stop()

    got, pushed = asyncio.run(body())
    assert got == expected
    engine = LLMEngine(EngineConfig(model=str(checkpoint), max_model_len=512, num_kv_blocks=64))
    layout, hidden = engine.layout, engine.hidden_width * engine.layout.itemsize
    # stored layers only (two of six layers are KV-shared): every block of the full layers, the sliding layers'
    # blocks inside the window of the first decoded token only; plus the hidden states
    units = [u for p in prompts for u in layout.handoff_units(len(p))]
    assert pushed == sum(layout.unit_nbytes(g) for g, _ in units) + sum(len(p) for p in prompts) * hidden
    assert len(layout.stored_layers) == 4 and len(layout.groups) == 2
    assert [i for g, i in layout.handoff_units(40) if g == 1] == [2]  # window 8, next query at 40: block 2 only


# Rounds of fresh prompts the swap-in test runs at most until a resumed request has read its context back
_SWAP_IN_ROUNDS = 3


def test_preempted_contexts_swap_back_in_with_layer_groups(checkpoint: Path) -> None:
    """A decode short of blocks parks preempted contexts in kv_transfer (kv_spill.py): the full layers' every block,
    the sliding layers' window; resumed requests read them back and decode the same tokens as colocated.

    Whether a resumed request reads its context back or still finds it in the decode's own prefix cache (nothing
    reused its freed blocks meanwhile) depends on when the handoffs land: a round that read nothing back (seen
    once in a full `make test`) is followed by another of fresh prompts, each round's tokens checked."""
    rounds = [[list(range(1000 * r + 100 * i + 10, 1000 * r + 100 * i + 10 + n)) for i, n in enumerate((21, 34, 27, 40))]
              for r in range(_SWAP_IN_ROUNDS)]
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0)
    colocated = LLMEngine(EngineConfig(model=str(checkpoint), max_model_len=512, kv_cache_bytes=16 << 20))
    expected = [[r.token_ids for r in colocated.generate(prompts, params)] for prompts in rounds]
    colocated.close()

    async def body() -> list[list[list[int]]]:
        kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
        prefill = await start_prefill(PrefillSettings(**engine_settings(checkpoint)))
        # 7 blocks of 16 tokens: four requests of 61-80 tokens take turns, one of 96 still fits
        decode = await start_decode(DecodeSettings(**dict(engine_settings(checkpoint), num_kv_blocks=7,
                                                          max_model_len=96), kv_spill=True))
        stack = Stack(kv, prefill, decode)
        engine = decode.host.aengine.engine
        outputs = []
        try:
            for prompts in rounds:
                got = await asyncio.gather(*(stack.generate(p, params) for p in prompts))
                outputs.append([tokens for tokens, _ in got])
                assert engine.spill is not None
                if engine.spill.swapped_in_blocks > 0:
                    break
            assert engine.scheduler.num_preemptions_total > 0 and len(engine.layout.groups) == 2
            assert engine.spill is not None and engine.spill.spilled_units > 0 and engine.spill.swapped_in_blocks > 0
            assert engine.remote is not None
            assert engine.remote.stats.by_direction["swap_in"].failures == 0
            await asyncio.sleep(0.2)
            assert stack.engines_idle() and kv.store.active_leases == 0
            return outputs
        finally:
            for s in (decode, prefill, kv):
                await s.stop()

    got = asyncio.run(body())
    assert got == expected[:len(got)]
