"""Engine behaviour on tiny random models: exactness, batching, preemption, roles, aborts."""

from __future__ import annotations

import pytest
import torch

from shared.engine.request import SamplingParams
from shared.errors import ContextLengthExceededError, InvalidRequestError
from shared.models.weight_format import WeightFormat
from tests.helpers.models import reference_logits, tiny_engine, tiny_loaded

FAMILIES = ["llama", "gemma3", "gemma4"]


def prompts(n: int, seed: int = 1, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(2, 256, (n_,), generator=g).tolist() for n_ in lens]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family: str) -> None:
    loaded, hf = tiny_loaded(family)
    ids = prompts(1, lo=30, hi=31)[0]  # longer than gemma's window of 8
    ours = reference_logits(loaded.model, ids, block_size=4)
    theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(make_tiny, family: str) -> None:
    engine, hf = make_tiny(family)
    batch = prompts(3)
    results = engine.generate(batch, greedy(24))
    for prompt, res in zip(batch, results, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert res.token_ids == out[0, len(prompt):].tolist()
        assert res.finish_reason == "length"


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariance_chunked_prefill_and_prefix_hits(make_tiny, family: str) -> None:
    batch = prompts(8)
    alone_engine, _ = make_tiny(family)
    alone = [alone_engine.generate([p], greedy(16))[0].token_ids for p in batch]
    # small token budget: prompts are split into chunks and mixed with decode tokens
    chunked_engine, _ = make_tiny(family, max_num_batched_tokens=10)
    chunked = [r.token_ids for r in chunked_engine.generate(batch, greedy(16))]
    assert chunked == alone
    # run again on the same engine: full prompt blocks now come from the prefix cache
    again = chunked_engine.generate(batch, greedy(16))
    assert [r.token_ids for r in again] == alone
    assert sum(r.num_cached_tokens for r in again) > 0


def test_prefix_cache_computes_only_new_tokens(make_tiny) -> None:
    engine, _ = make_tiny("llama")
    shared = prompts(1, lo=24, hi=25)[0]
    first = engine.generate([shared + [5, 6, 7]], greedy(4))[0]
    second = engine.generate([shared + [9, 9]], greedy(4))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 24  # six full blocks of 4


def test_preemption_recomputes_to_the_same_tokens(make_tiny) -> None:
    batch = prompts(8, lo=10, hi=20)
    roomy, _ = make_tiny("llama")
    expected = [r.token_ids for r in roomy.generate(batch, greedy(30))]
    tight, _ = make_tiny("llama", num_kv_blocks=32, max_model_len=128)  # 128 tokens for ~8 x 45
    got = [r.token_ids for r in tight.generate(batch, greedy(30))]
    assert tight.scheduler.num_preemptions_total > 0
    assert got == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_to_decode_handoff_equals_colocated(make_tiny, engines, family: str) -> None:
    batch = prompts(4)
    params = [greedy(12), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7),
              SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=11, logprobs=2), greedy(1)]
    colo, _ = make_tiny(family)
    expected = colo.generate(batch, params)
    loaded = colo.loaded
    prefill = tiny_engine(loaded, role="prefill")
    decode = tiny_engine(loaded, role="decode", block_size=4)
    engines.extend([prefill, decode])
    handoffs = prefill.generate(batch, params)
    for i, (h, p) in enumerate(zip(handoffs, params, strict=True)):
        if p.max_tokens == 1:  # the first token ends it: prefill finishes the request itself
            assert h.finish_reason == "length" and h.handoff is None
            assert h.token_ids == expected[i].token_ids
            continue
        assert h.finish_reason == "handoff" and h.handoff is not None
        assert h.handoff.hidden_states.shape == (len(batch[i]), loaded.spec.hidden_size)
        assert decode.add_handoff(f"d{i}", p, h.handoff) is None
    results = decode.run_to_completion()
    for i, exp in enumerate(expected):
        if params[i].max_tokens == 1:
            continue
        got = [handoffs[i].handoff.first_token_id] + results[f"d{i}"].token_ids
        assert got == exp.token_ids, f"request {i}"
        assert results[f"d{i}"].finish_reason == exp.finish_reason
    if params[2].logprobs:  # the first token's logprobs travel with the handoff
        assert handoffs[2].handoff.first_logprobs == expected[2].logprobs[0]


def test_prefill_hidden_states_match_across_chunks(make_tiny) -> None:
    one_shot, _ = make_tiny("llama", role="prefill")
    chunked, _ = make_tiny("llama", role="prefill", max_num_batched_tokens=7)
    p = prompts(1, lo=30, hi=31)
    a = one_shot.generate(p, greedy(2))[0].handoff
    b = chunked.generate(p, greedy(2))[0].handoff
    torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.kv, b.kv, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_repeats_regardless_of_batch(make_tiny) -> None:
    engine, _ = make_tiny("llama")
    p = prompts(5)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=1234)
    alone = engine.generate([p[0]], seeded)[0].token_ids
    assert engine.generate([p[0]], seeded)[0].token_ids == alone
    assert len(set(alone)) > 3  # really sampled
    batch = engine.generate([p[1], p[0], p[2]], [SamplingParams(max_tokens=20, temperature=1.0), seeded,
                                                   SamplingParams(max_tokens=20, temperature=0.7, seed=3)])
    assert batch[1].token_ids == alone


def test_logprobs_are_raw_log_softmax(make_tiny) -> None:
    engine, hf = make_tiny("llama")
    prompt = prompts(1)[0]
    res = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=3))[0]
    ids = prompt + res.token_ids
    ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    for i, lp in enumerate(res.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == res.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()


def test_abort_at_every_stage_frees_blocks(make_tiny) -> None:
    engine, _ = make_tiny("llama", max_num_batched_tokens=8)
    batch = prompts(4, lo=20, hi=30)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, greedy(50))
    engine.add_request("waiting", batch[0], greedy(5))
    assert engine.abort("waiting")
    engine.step()  # r0 is mid chunked prefill
    assert engine.abort("r0")
    for _ in range(12):
        engine.step()
    assert engine.abort("r1") and engine.abort("r2") and engine.abort("r3")
    assert not engine.abort("r1")  # second abort finds nothing
    assert engine.step() == []  # the step in flight (zero-bubble loop) ends; nothing aborted comes out
    assert not engine.has_unfinished()
    assert engine.num_free_kv_blocks == engine.num_kv_blocks


def test_bad_input_raises_typed_errors(make_tiny) -> None:
    engine, _ = make_tiny("llama", max_model_len=64)
    with pytest.raises(ContextLengthExceededError, match="context"):
        engine.add_request("long", list(range(2, 66)), greedy(1))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("oov", [5, 99999], greedy(1))
    with pytest.raises(InvalidRequestError, match="at least one token"):
        engine.add_request("empty", [], greedy(1))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_decode_engine_computes_a_prompt_itself_as_a_colocated_one_does(make_tiny) -> None:
    """The router may send a decode instance a short (or mostly cached) prompt with no handoff."""
    colocated, _ = make_tiny("llama")
    decode, _ = make_tiny("llama", role="decode")
    prompt = prompts(1, lo=12, hi=13)[0]
    expected = colocated.generate([prompt], greedy(8))[0].token_ids
    assert decode.generate([prompt], greedy(8))[0].token_ids == expected
    assert decode.generate([prompt], greedy(8))[0].token_ids == expected  # again, from its prefix cache


def test_prefill_hidden_states_cover_only_computed_positions(make_tiny) -> None:
    engine, _ = make_tiny("llama", role="prefill")
    p = prompts(1, lo=30, hi=31)[0]
    first = engine.generate([p], greedy(2))[0].handoff
    second = engine.generate([p], greedy(2))[0].handoff  # 28 of 30 tokens now cached (7 blocks of 4)
    assert first.hidden_start == 0 and first.hidden_states.shape[0] == 30
    assert second.hidden_start == 28 and second.hidden_states.shape[0] == 2
    torch.testing.assert_close(second.hidden_states, first.hidden_states[28:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second.kv, first.kv)


def test_a_handoff_whose_kv_does_not_fit_is_refused_before_it_holds_blocks(make_tiny, engines) -> None:
    """KV of another shape (a truncated handoff) is a clear error; the decode engine holds nothing after it
    (the engines fixture checks for leaked blocks) and serves the same handoff whole afterwards."""
    from dataclasses import replace

    engine, _ = make_tiny("llama")
    handoff = tiny_engine(engine.loaded, role="prefill").generate([[3, 4, 5, 6, 7, 8]], greedy(3))[0].handoff
    assert handoff is not None
    decode = tiny_engine(engine.loaded, role="decode")
    engines.append(decode)
    with pytest.raises(InvalidRequestError, match="does not fit"):
        decode.add_handoff("short", greedy(3), replace(handoff, kv=handoff.kv[:, :-1]))
    assert not decode.has_unfinished()
    assert decode.add_handoff("whole", greedy(3), handoff) is None
    assert len(decode.run_to_completion()["whole"].token_ids) == 2


def test_duplicate_request_ids_are_refused(make_tiny, engines) -> None:
    engine, _ = make_tiny("llama")
    engine.add_request("dup", [3, 4, 5], greedy(2))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("dup", [3, 4, 5], greedy(2))
    handoff = tiny_engine(engine.loaded, role="prefill").generate([[3, 4, 5, 6]], greedy(2))[0].handoff
    decode = tiny_engine(engine.loaded, role="decode")
    engines.append(decode)
    decode.add_handoff("h", greedy(2), handoff)
    with pytest.raises(InvalidRequestError, match="duplicate"):
        decode.add_handoff("h", greedy(2), handoff)
    engine.run_to_completion()
    decode.run_to_completion()


# (engine config, how the projections are stored, the KV cache's dtype)
LOW_PRECISIONS = {
    "bf16": ({"dtype": "bfloat16"}, WeightFormat(torch.bfloat16), torch.bfloat16),
    "int8-bf16kv": ({"quantization": "int8", "kv_cache_dtype": "bfloat16"}, WeightFormat(quantization="int8"),
                    torch.bfloat16),
    "int8-fp8kv": ({"quantization": "int8", "kv_cache_dtype": "fp8"}, WeightFormat(quantization="int8"),
                   torch.float8_e4m3fn),
    "bf16-fp8e5m2kv": ({"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2"}, WeightFormat(torch.bfloat16),
                       torch.float8_e5m2),
}


@pytest.mark.parametrize("precision", list(LOW_PRECISIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_low_precisions_are_batch_invariant_and_hand_off_exactly(engines, family: str, precision: str) -> None:
    """bf16 projections and KV (--dtype bfloat16), or int8 projections and a bf16 KV cache: a prompt gives the
    same tokens alone, chunked in a batch, and continued by a decode engine from the KV a prefill engine handed
    over (a bf16 cache: half the bytes of the fp32 handoff)."""
    config, fmt, kv_dtype = LOW_PRECISIONS[precision]
    loaded, _ = tiny_loaded(family, weight_format=fmt)
    batch = prompts(6)
    alone_engine = tiny_engine(loaded, **config)
    chunked_engine = tiny_engine(loaded, max_num_batched_tokens=10, **config)
    prefill = tiny_engine(loaded, role="prefill", **config)
    decode = tiny_engine(loaded, role="decode", **config)
    engines.extend([alone_engine, chunked_engine, prefill, decode])
    assert alone_engine.layout.dtype == kv_dtype
    alone = [alone_engine.generate([p], greedy(12))[0].token_ids for p in batch]
    assert [r.token_ids for r in chunked_engine.generate(batch, greedy(12))] == alone
    handoffs = prefill.generate(batch, greedy(12))
    for i, h in enumerate(handoffs):
        assert h.handoff is not None and h.handoff.kv.dtype == kv_dtype
        assert decode.add_handoff(f"d{i}", greedy(12), h.handoff) is None
    results = decode.run_to_completion()
    assert [[h.handoff.first_token_id] + results[f"d{i}"].token_ids  # type: ignore[union-attr]
            for i, h in enumerate(handoffs)] == alone


def test_a_model_loaded_in_another_dtype_is_refused() -> None:
    from shared.errors import ConfigError

    loaded, _ = tiny_loaded("llama")
    with pytest.raises(ConfigError, match="bfloat16"):
        tiny_engine(loaded, dtype="bfloat16")


def test_prefix_hashes_name_the_precision(engines) -> None:
    """kv_transfer's pool is shared by every engine of a model: an fp32 and a bf16 cache's blocks must never
    match each other's prefix hashes."""
    loaded, _ = tiny_loaded("llama")
    fp32 = tiny_engine(loaded)
    bf16_kv = tiny_engine(loaded, kv_cache_dtype="bfloat16")
    engines.extend([fp32, bf16_kv])
    assert fp32.kv.hash_salt != bf16_kv.kv.hash_salt


def test_preempted_requests_swap_their_context_back_in_from_the_host_tier(make_tiny) -> None:
    """With kv_offload_bytes, blocks the pool evicts are spilled to host memory and restored when their
    request resumes: the same tokens, fewer computed, restores counted and timed, nothing leaked."""
    batch = prompts(8, lo=10, hi=20)
    roomy, _ = make_tiny("llama")
    expected = [r.token_ids for r in roomy.generate(batch, greedy(30))]
    computed = {}
    for offload in (0, 1 << 20):
        tight, _ = make_tiny("llama", num_kv_blocks=32, max_model_len=128, kv_offload_bytes=offload)
        assert [r.token_ids for r in tight.generate(batch, greedy(30))] == expected, offload
        assert tight.scheduler.num_preemptions_total > 0
        computed[offload] = tight.scheduler.num_scheduled_tokens_total
    tier = tight.kv.tier
    assert tier is not None and tier.stats.spilled_blocks > 0 and tier.stats.restored_blocks > 0
    assert tier.stats.swap_in.count > 0 and len(tier.stats.recent_swap_in_s) == tier.stats.swap_in.count
    assert computed[1 << 20] < computed[0], computed


def test_the_host_tier_gives_an_evicted_prefix_back_bit_for_bit(make_tiny) -> None:
    engine, _ = make_tiny("llama", num_kv_blocks=24, max_model_len=64, kv_offload_bytes=1 << 20)
    first, other = prompts(2, seed=5, lo=40, hi=41)
    before = engine.generate([first], greedy(8))[0]
    engine.generate([other, other[::-1]], greedy(8))  # fills the pool: the first prompt's blocks are evicted
    assert engine.kv.tier is not None and engine.kv.tier.stats.spilled_blocks > 0
    again = engine.generate([first], greedy(8))[0]
    assert again.token_ids == before.token_ids
    assert again.num_cached_tokens > 0 and engine.kv.tier.stats.restored_blocks > 0
