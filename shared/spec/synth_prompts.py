"""Chat requests written by the target itself, for `baton train-draft` (the Magpie recipe).

An instruction-tuned model given its chat template up to where a user's message
begins writes a user's message: sampled, it writes a different request each
time, in the topics and phrasing its own training left it with. The bundled
prompt set is 64 written requests plus 20 templates crossed with 82 subjects.
A head trained on the replies to those (train-draft's CPU defaults) keeps 1.66
tokens per step on the held-out questions and 1.81 on the written requests' own
replies (bench/eagle_offline.py), but 2.30 on 24 of its sequences drawn at
random, mostly templated: templated text is easy, real questions are not. A
head trained with 9,321 requests the model wrote beside them (12,000 sampled;
2 minutes on an H100, the replies 8), and longer (6,000 steps of 64 windows,
not 1,300 of 16), keeps 1.87 on the held-out questions and 1.85 on the written
requests' replies (1.76 served over 64 tokens, was 1.56).

    template up to the user's message ─► sample (temperature 1, top-p 0.95) until the end of the turn
        ─► keep the finished ones of a sensible length, drop repeats ─► requests for the chat template
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["synthesize_requests", "user_turn_prefix"]

_SENTINEL = "\x00baton-user-message\x00"
MIN_WORDS = 4  # shorter samples are mostly fragments, not requests


def user_turn_prefix(tokenizer: Any, chat_template: str | None = None) -> list[int]:
    """Token ids of the chat template rendered up to the first character of a user's message."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("synthesizing chat requests needs a chat template (this is a base model)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], chat_template=template,
                                         tokenize=False, add_generation_prompt=False)
    return list(tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False).input_ids)


def synthesize_requests(
    engine: LLMEngine, count: int, max_tokens: int = 64, seed: int = 0, chat_template: str | None = None,
    exclude: Iterable[str] = (),
) -> list[str]:
    """Up to `count` distinct user requests the engine's model wrote (send them through the chat template).

    Requests cut off at `max_tokens`, of fewer than MIN_WORDS words, or equal to one in `exclude` (the
    held-out questions, compared without case) are dropped, so fewer than `count` come back (78% of
    samples were kept on SmolLM2-135M-Instruct)."""
    tokenizer = engine.loaded.tokenizer
    prefix = user_turn_prefix(tokenizer, chat_template)
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed * 1_000_003 + i)
              for i in range(count)]
    with tqdm(total=count, desc="synthesize prompts", unit="req", file=sys.stderr) as bar:
        results = engine.generate([prefix] * count, params, lambda out: bar.update(int(out.finished)))
    seen = {e.strip().lower() for e in exclude}
    requests = []
    for r in results:
        text = tokenizer.decode(r.token_ids, skip_special_tokens=True).strip()
        if r.finish_reason != "stop" or len(text.split()) < MIN_WORDS or text.lower() in seen:
            continue
        seen.add(text.lower())
        requests.append(text)
    logger.info("synthesized %d distinct requests from %d samples", len(requests), count)
    return requests
