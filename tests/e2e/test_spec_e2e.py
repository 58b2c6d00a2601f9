"""Speculative decoding through the OpenAI API on the disaggregated path: `baton up --spec ...`.

For every method, greedy replies through router -> prefill -> kv_transfer ->
speculating decode, streamed and not, equal the plain engine's (float-noise
ties excepted, as in the fidelity tests), and the decode service's counters
show that drafts were verified. The EAGLE head is untrained: exactness never
depends on its quality.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from shared.engine.request import SamplingParams
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged, packaged_engine
from tests.helpers.stack import start_stack
from tests.integration.engine.test_spec_fidelity import assert_same_greedy
from tests.integration.services.test_spec_disagg import TREE, random_head

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPTS = ["Repeat exactly: one two three, one two three, one two three.", "What is the capital of France?"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected() -> list[tuple[list[int], list[int]]]:
    """(prompt ids, plain greedy reply ids) for each prompt, from the engine in this process."""
    tok = packaged(MODEL).tokenizer
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    engine = packaged_engine(MODEL, max_model_len=1024)
    replies = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [(prompt, r.token_ids) for prompt, r in zip(prompts, replies, strict=True)]


def reply_text(c: openai.OpenAI, prompt: str, stream: bool) -> str:
    messages = [{"role": "user", "content": prompt}]
    if stream:
        chunks = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)  # type: ignore[call-overload]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0)  # type: ignore[call-overload]
        text = reply.choices[0].message.content or ""
    return text


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle", "eagle-tree"])
def test_speculating_stack_equals_plain_greedy(method: str, expected: list[tuple[list[int], list[int]]],
                                               tmp_path: Path) -> None:
    args = ["--model", MODEL, "--max-model-len", "1024", "--kv-cache-bytes", str(96 << 20),
            "--spec", method.removesuffix("-tree"), "--num-speculative-tokens", "3"]
    if method.startswith("eagle"):
        args += ["--spec-eagle-head", str(random_head(tmp_path / "head.safetensors"))]
    if method == "eagle-tree":
        args += ["--spec-tree", TREE]
    stack = start_stack(tmp_path / "stack", *args)
    try:
        c = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
        tok = packaged(MODEL).tokenizer
        for prompt, (prompt_ids, want) in zip(PROMPTS, expected, strict=True):
            for stream in (False, True):
                text = reply_text(c, prompt, stream)
                if text != tok.decode(want, skip_special_tokens=True):  # allowed only at a float-noise tie
                    assert_same_greedy(list(tok.encode(text, add_special_tokens=False)), want, prompt_ids)
        assert stack.metric("decode-0", "baton_spec_decode_draft_tokens_total") > 0
    finally:
        stack.stop()
