"""Gemma 4 text against transformers 5.24, one tiny config per branch of Gemma4TextConfig.

Logits of a prompt longer than the sliding window within fp32 tolerance; greedy
tokens through the engine (continuous batching, chunked prefill, the paged
cache with per-layer head dims and KV-shared layers) identical to transformers'
`generate`, in the synchronous and the zero-bubble loop.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine.request import SamplingParams
from tests.helpers.gemma4 import VARIANTS, hf_greedy, hf_logits
from tests.helpers.models import reference_logits, tiny_engine, tiny_loaded
from tests.integration.engine.test_engine_tiny import greedy, prompts

VARIANT_NAMES = sorted(VARIANTS)


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_logits_match_transformers(variant: str) -> None:
    loaded, hf = tiny_loaded(f"gemma4-{variant}")
    ids = prompts(1, lo=30, hi=31)[0]  # five windows long
    ours = reference_logits(loaded.model, ids, block_size=4)
    theirs = hf_logits(hf, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("zero_bubble", [False, True], ids=["sync", "zero_bubble"])
def test_greedy_engine_matches_transformers(engines, variant: str, zero_bubble: bool) -> None:
    loaded, hf = tiny_loaded(f"gemma4-{variant}")
    # a small token budget splits prompts into chunks mixed with decode tokens
    engine = tiny_engine(loaded, async_scheduling=zero_bubble, max_num_batched_tokens=16)
    engines.append(engine)
    batch = prompts(3, seed=4, lo=5, hi=30)
    results = engine.generate(batch, greedy(16))
    for prompt, res in zip(batch, results, strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 16)


def test_kv_shared_layers_store_nothing_and_k_eq_v_layers_no_values() -> None:
    loaded, _ = tiny_loaded("gemma4-all")
    kv_layers = loaded.spec.kv_layers
    # layers 3..5 read the last sliding (1) and full (2) layer before them
    assert [g.reads_layer for g in kv_layers] == [None, None, None, 1, 1, 2]
    assert [g.head_dim for g in kv_layers] == [16, 16, 32, 16, 16, 32]
    assert [g.num_kv_heads for g in kv_layers] == [2, 2, 1, 2, 2, 1]
    assert [g.sliding_window for g in kv_layers] == [6, 6, None, 6, 6, None]


def test_sampling_runs_and_is_seeded(engines) -> None:
    loaded, _ = tiny_loaded("gemma4-all")
    engine = tiny_engine(loaded)
    engines.append(engine)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3)
    batch = prompts(2, seed=5)
    first = [r.token_ids for r in engine.generate(batch, params)]
    again = [r.token_ids for r in engine.generate(batch, params)]
    assert first == again and all(len(t) == 12 for t in first)


def test_bf16_weights_and_kv_cache_decode_close_to_fp32(engines) -> None:
    """--dtype bfloat16 on the "all" config (MoE, K=V, KV-shared, PLE): the experts are stored and run in
    bf16 like the projections, the K=V layers' keys are rebuilt in the bf16 cache's dtype, and the engine
    decodes through the C++ attention kernel with logits close to fp32's."""
    from shared.models.gemma4.moe_cpu import PackedExperts
    from shared.models.weight_format import WeightFormat

    loaded, hf = tiny_loaded("gemma4-all", weight_format=WeightFormat(torch.bfloat16))
    experts = loaded.model.w.layers[0].moe.experts
    assert isinstance(experts, PackedExperts) and experts.gate_up.dtype == torch.bfloat16
    engine = tiny_engine(loaded, dtype="bfloat16", kv_cache_dtype="bfloat16", max_num_batched_tokens=16)
    engines.append(engine)
    batch = prompts(3, seed=4, lo=5, hi=30)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompt, res in zip(batch, engine.generate(batch, params), strict=True):
        assert len(res.token_ids) == 8
        # teacher-forced on what bf16 chose: fp32's log-probability of each chosen token is near its best
        theirs = hf_logits(hf, prompt + res.token_ids).log_softmax(-1)[len(prompt) - 1:-1]
        chosen = theirs.gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
        assert (theirs.max(-1).values - chosen).max() < 0.5, (theirs.max(-1).values - chosen)


@pytest.mark.parametrize(("quantization", "pack_dtype", "max_gap"), [
    ("int8", torch.int8, 0.5), ("q4_1", torch.uint8, 1.0)], ids=["int8", "q4_1"])
def test_quantized_weights_with_quantized_experts_decode_close_to_fp32(
        engines, quantization: str, pack_dtype: torch.dtype, max_gap: float) -> None:
    """--quantization int8 / q4_1 on the "all" config with an expert width in whole blocks of 32: the experts
    are quantized like the projections (int8 per channel through the W8A8 kernel, 4-bit blocks through
    qgemv), and what it decodes is near fp32's best (within `max_gap` nats of fp32's top token)."""
    from shared.models.gemma4.moe_cpu import PackedExperts
    from shared.models.weight_format import WeightFormat

    loaded, hf = tiny_loaded("gemma4-all", weight_format=WeightFormat(quantization=quantization),
                             moe_intermediate_size=32)
    experts = loaded.model.w.layers[0].moe.experts
    assert isinstance(experts, PackedExperts) and experts.gate_up.dtype == pack_dtype
    engine = tiny_engine(loaded, quantization=quantization, max_num_batched_tokens=16)
    engines.append(engine)
    batch = prompts(3, seed=4, lo=5, hi=30)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt, res in zip(batch, engine.generate(batch, params), strict=True):
        assert len(res.token_ids) == 8
        theirs = hf_logits(hf, prompt + res.token_ids).log_softmax(-1)[len(prompt) - 1:-1]
        chosen = theirs.gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
        assert (theirs.max(-1).values - chosen).max() < max_gap, (theirs.max(-1).values - chosen)
