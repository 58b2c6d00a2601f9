"""Chat requests written by the target itself, for `baton train-draft` (the Magpie recipe).

An instruction-tuned model given its chat template up to where a user's message
begins writes a user's message: sampled, it writes a different request each
time, in the topics and phrasing its own training left it with. The bundled
prompt set is 20 templates crossed with 82 subjects; a head trained on the
replies to those alone reached 2.30 tokens per step on its training text yet
1.66 on held-out questions (the same head, measured the same way): it learnt
the templates' answers rather than the model's. Requests the model writes
itself are as varied as we sample them, at no cost in bundled text.

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
MIN_WORDS = 4  # shorter requests are mostly fragments ("Fiaefia:")


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
    held-out questions, compared without case) are dropped, so fewer than `count` come back (about 60% of
    samples are kept on SmolLM2-135M-Instruct)."""
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
