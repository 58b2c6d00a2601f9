"""From a request body's sampling fields to `SamplingParams`, stop strings and the token budget.

    body ──► defaults (the model's generation_config fills what the body leaves out)
         ──► refusals (what the engines do not do yet: engine_features.py; n above the limit)
         ──► SamplingParams (validated again on construction)

Context length follows vLLM: a prompt of max_model_len tokens or more is refused; an
explicit max_tokens that does not fit beside the prompt is refused (400,
context_length_exceeded); an absent one (null) means "up to the end of the context".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from services.router.engine_features import (
    LOGITS_PROCESSING,
    MULTIPLE_CHOICES,
    PROMPT_LOGPROBS,
    has,
    require,
)
from services.router.protocol import SamplingRequest
from services.router.settings import RouterSettings
from shared.engine.request import SamplingParams
from shared.errors import ContextLengthExceededError, InvalidRequestError
from shared.models.generation_config import GenerationDefaults

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Asked:
    """What the body asked for, and under which field names (for errors)."""

    max_tokens: int | None
    logprobs: int | None
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    logprobs_param: str = "logprobs"


def stop_strings(body: SamplingRequest, settings: RouterSettings) -> tuple[str, ...]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > settings.max_stop_strings:
        raise InvalidRequestError(f"at most {settings.max_stop_strings} stop strings are allowed", param="stop")
    for s in stop:
        if not s or len(s) > settings.max_stop_string_chars:
            raise InvalidRequestError(
                f"stop strings must have 1 to {settings.max_stop_string_chars} characters", param="stop"
            )
    return tuple(dict.fromkeys(stop))


def max_tokens(asked: Asked, num_prompt_tokens: int, max_model_len: int, limit: int = 0) -> int:
    """The completion's token budget: what the request asked, else the context's remainder; `limit` (> 0)
    caps both (the operator's max_tokens_limit: a larger ask is a 400, an unset one gets the limit)."""
    requested = asked.max_tokens
    if limit and requested is not None and requested > limit:
        raise InvalidRequestError(f"{asked.max_tokens_param} must be <= {limit} on this server, got {requested}",
                                  param=asked.max_tokens_param)
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, and at least one token must be generated. Please shorten the prompt.",
            param=asked.prompt_param,
        )
    if requested is None:
        remainder = max_model_len - num_prompt_tokens
        return min(remainder, limit) if limit else remainder
    if requested >= 1 and num_prompt_tokens + requested > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} in the "
            "completion). Please reduce the length of the prompt or the completion.",
            param=asked.max_tokens_param,
        )
    if requested < 1:
        raise InvalidRequestError(f"{asked.max_tokens_param} must be >= 1, got {requested}",
                                  param=asked.max_tokens_param)
    return requested


def check_logprobs(asked: Asked, settings: RouterSettings) -> None:
    if asked.logprobs is not None and not 0 <= asked.logprobs <= settings.max_logprobs:
        raise InvalidRequestError(f"{asked.logprobs_param} must be in [0, {settings.max_logprobs}]",
                                  param=asked.logprobs_param)


def _num_choices(body: SamplingRequest, settings: RouterSettings) -> int:
    n = 1 if body.n is None else body.n
    if n < 1 or n > settings.max_n:
        raise InvalidRequestError(f"n must be in [1, {settings.max_n}], got {n}", param="n")
    if n > 1:
        require(MULTIPLE_CHOICES, "n", "n > 1")
    return n


def _logit_bias(body: SamplingRequest, vocab_size: int) -> tuple[tuple[int, float], ...]:
    entries = []
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size}), got {token_id}",
                                      param="logit_bias")
        entries.append((token_id, float(bias)))
    return tuple(entries)


def _logits_processing(body: SamplingRequest, defaults: GenerationDefaults, vocab_size: int) -> dict[str, Any]:
    """Penalties, logit_bias and min_p: the body's, else the model's defaults (once the engines do them)."""
    asked = {
        "presence_penalty": body.presence_penalty not in (None, 0.0),
        "frequency_penalty": body.frequency_penalty not in (None, 0.0),
        "repetition_penalty": body.repetition_penalty not in (None, 1.0),
        "min_p": body.min_p not in (None, 0.0),
        "logit_bias": bool(body.logit_bias),
    }
    for name, given in asked.items():
        if given:
            require(LOGITS_PROCESSING, name)
    values: dict[str, Any] = {"logit_bias": _logit_bias(body, vocab_size)}
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) is not None:
            values[name] = getattr(body, name)
    for name in ("repetition_penalty", "min_p"):
        value = getattr(body, name)
        if value is None and has(LOGITS_PROCESSING):
            value = getattr(defaults, name)
        if value is not None:
            values[name] = value
    return values


def sampling_params(
    body: SamplingRequest, num_tokens: int, logprobs: int | None, settings: RouterSettings,
    defaults: GenerationDefaults, vocab_size: int,
) -> SamplingParams:
    """The engine's parameters for this body; fields it leaves out take the model's defaults."""
    if body.prompt_logprobs is not None:
        require(PROMPT_LOGPROBS, "prompt_logprobs")
    temperature = body.temperature if body.temperature is not None else defaults.temperature
    top_p = body.top_p if body.top_p is not None else defaults.top_p
    top_k = body.top_k if body.top_k is not None else defaults.top_k
    return SamplingParams(
        max_tokens=num_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        n=_num_choices(body, settings),
        prompt_logprobs=body.prompt_logprobs,
        stream_interval=body.stream_interval,
        **_logits_processing(body, defaults, vocab_size),
    )
