"""Fidelity on the packaged models: our engine against transformers, same weights, fp32.

Greedy tokens must be equal; a divergence is accepted only at a step where
transformers' own top-2 logits are within 1e-3 (a float-noise tie).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shared.engine.request import SamplingParams
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged, reference_logits
from tests.helpers.near_tie import NEAR_TIE, assert_near_tie

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
]
PLAIN_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
NUM_TOKENS = 64


def _hf_model(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(packaged(name).hf_dir, dtype=torch.float32).eval()


def _prompts(name: str) -> list[list[int]]:
    loaded = packaged(name)
    if name == "smollm2-135m":
        return [encode_prompt(loaded.tokenizer, p, chat=True) for p in CHAT_PROMPTS]
    return [encode_prompt(loaded.tokenizer, p) for p in PLAIN_PROMPTS]


def assert_same_greedy(ours: list[int], theirs: list[int], hf: Any, prompt: list[int]) -> None:
    if ours == theirs:
        return
    i = next(k for k, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
    assert_near_tie(logits, ours[i], theirs[i], i)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_greedy_64_tokens_match_transformers(make_packaged, name: str) -> None:
    engine = make_packaged(name)
    hf = _hf_model(name)
    batch = _prompts(name)
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0.0)
    results = engine.generate(batch, params)
    for prompt, res in zip(batch, results, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                              do_sample=False)
        assert len(res.token_ids) == NUM_TOKENS
        assert_same_greedy(res.token_ids, out[0, len(prompt):].tolist(), hf, prompt)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_prefill_logits_match_transformers(name: str) -> None:
    """Max abs logit difference over every prompt position stays below 2e-3 (fp32)."""
    loaded = packaged(name)
    hf = _hf_model(name)
    long_prompt = sum(_prompts(name), [])
    if name == "gemma3-270m":  # reach past the 512-token sliding window
        long_prompt = (long_prompt * 40)[:700]
    ours = reference_logits(loaded.model, long_prompt)
    with torch.no_grad():
        theirs = hf(torch.tensor([long_prompt])).logits[0]
    diff = (ours - theirs).abs().max().item()
    assert diff < 2e-3, f"max |logit diff| = {diff}"


@pytest.mark.parametrize("serving", [False, True], ids=["reference", "serving"])
def test_batch_invariance_on_smollm2(make_packaged, serving: bool) -> None:
    """Same tokens alone, in a batch of 8 mixed lengths with chunked prefill, and with prefix hits; with the
    reference attention, and on the serving path (CPU kernels; C++ layer loop for decode steps, Python for
    steps with prompt chunks)."""
    loaded = packaged("smollm2-135m", serving)
    questions = ["Hi!", "Name three colors.", "What is 2+2? Answer briefly.", "Tell me a fun fact about owls.",
                 "Translate 'good morning' to French.", "List the planets of the solar system in order.",
                 "What does a CPU do?", "Give me a short motivational quote."]
    batch = [encode_prompt(loaded.tokenizer, q, chat=True) for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    alone_engine = make_packaged("smollm2-135m", serving, enable_prefix_caching=False)
    alone = [alone_engine.generate([p], params)[0] for p in batch]
    engine = make_packaged("smollm2-135m", serving, max_num_batched_tokens=48)
    for _ in range(2):  # the second round hits the prefix cache (shared system prompt and more)
        together = engine.generate(batch, params)
        for a, t in zip(alone, together, strict=True):
            _assert_same_tie_rule(a, t)
    assert sum(r.num_cached_tokens for r in together) > 0


def _assert_same_tie_rule(a: Any, b: Any) -> None:
    """Equal tokens, or a first divergence where the top-2 logprobs were within NEAR_TIE."""
    if a.token_ids == b.token_ids:
        return
    i = next(k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y)
    (first_id, first), (second_id, second) = a.logprobs[i].top[:2]
    assert (first_id, second_id) == (a.token_ids[i], b.token_ids[i]), \
        f"token {i}: {b.token_ids[i]} is not the second choice ({second_id}) beside {first_id}"
    assert first - second < NEAR_TIE, f"diverged at token {i} with a clear winner ({first - second:.4g})"


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_serving_path_matches_transformers_and_its_python_loop(make_packaged, name: str) -> None:
    """The path a service runs here (CPU attention kernel; decode steps' layers in one C++ call) gives
    transformers' greedy tokens, and the C++ layer loop gives the Python loop's very bits (logprobs too)."""
    engine = make_packaged(name, serving=True, enable_prefix_caching=False)  # both runs prefill in full
    model = engine.loaded.model
    assert model.cpu_layer_loop is not None, "the serving path should run decode steps through the C++ loop"
    batch = _prompts(name)
    params = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0, logprobs=3)
    with_loop = engine.generate(batch, params)
    loop, model.cpu_layer_loop = model.cpu_layer_loop, None
    try:
        python_loop = engine.generate(batch, params)
    finally:
        model.cpu_layer_loop = loop
    for a, b in zip(with_loop, python_loop, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    hf = _hf_model(name)
    for prompt, res in zip(batch, with_loop, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert_same_greedy(res.token_ids, out[0, len(prompt):].tolist(), hf, prompt)
