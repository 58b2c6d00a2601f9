"""Speculation on the packaged SmolLM2: greedy output equals plain greedy output.

Verification runs k + 1 tokens of a request in one forward where plain decoding
runs one, so float summation order differs; a divergence is accepted only where
the plain run's own top-2 logits are within 1e-3 (a float-noise tie).
"""

from __future__ import annotations

import pytest

from shared.engine.request import SamplingParams
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged, reference_logits
from tests.helpers.near_tie import assert_near_tie

pytestmark = pytest.mark.slow

NAME = "smollm2-135m"
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump!")
PROMPTS = [
    f"Repeat the following text exactly.\n\n{TEXT}",
    "What is the capital of France?",
    f"Copy this sentence twice: {TEXT[:44]}",
    "List the numbers from 1 to 20, separated by commas.",
]


def assert_same_greedy(ours: list[int], plain: list[int], prompt: list[int]) -> None:
    if ours == plain:
        return
    i = next(k for k, (a, b) in enumerate(zip(ours, plain, strict=False)) if a != b)
    logits = reference_logits(packaged(NAME).model, prompt + plain[:i])[-1]
    assert_near_tie(logits, ours[i], plain[i], i)


def test_smollm2_greedy_ngram_equals_plain(make_packaged) -> None:
    tokenizer = packaged(NAME).tokenizer
    batch = [encode_prompt(tokenizer, p, chat=True) for p in PROMPTS]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = make_packaged(NAME, block_size=16)
    expected = [r.token_ids for r in plain.generate(batch, params)]
    # a small token budget splits the prompts (chunked prefill); the second pass hits the prefix cache
    spec = make_packaged(NAME, block_size=16, spec_method="ngram", num_speculative_tokens=4,
                         max_num_batched_tokens=32)
    for _ in range(2):
        got = [r.token_ids for r in spec.generate(batch, params)]
        for ours, theirs, prompt in zip(got, expected, batch, strict=True):
            assert_same_greedy(ours, theirs, prompt)
    assert spec.speculator is not None
    stats = spec.speculator.stats
    assert stats.num_accepted_tokens > 0
    assert stats.mean_acceptance_length > 1.5  # the repeat prompt is mostly copied
