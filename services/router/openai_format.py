"""What every OpenAI response format shares: collected choices, token strings, usage.

Streams, all kinds:   [chat: role chunk per choice] → content chunks (each with its choice's
index) → a finish chunk per choice (finish_reason) → [usage chunk: choices [] when
stream_options.include_usage] → [DONE]. Logprobs travel with the chunk of the tokens they
belong to; text may lag its tokens (held back while a character or a possible stop string
is incomplete).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from services.router.generation import Delta, PreparedRequest
from services.router.shapes import PromptTokensDetails, Usage
from shared.engine.request import TokenLogprobs
from shared.tokenizer import token_bytes

MIN_LOGPROB = -9999.0  # what OpenAI reports for -inf


@dataclass
class CollectedChoice:
    """One choice of a whole (non-streamed) generation."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Collected:
    """A whole (non-streamed) generation: its choices by index and token counts."""

    choices: dict[int, CollectedChoice] = field(default_factory=dict)
    num_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, delta: Delta) -> None:
        choice = self.choices.setdefault(delta.index, CollectedChoice())
        choice.text += delta.text
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs)
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        self.num_tokens += len(delta.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)

    def in_order(self) -> list[tuple[int, CollectedChoice]]:
        return sorted(self.choices.items())


class TokenStrings:
    """Each token's text and bytes as logprobs show them (cached per token id)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            raw = token_bytes(self._tokenizer, token_id)
            entry = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return entry


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def usage(prepared: PreparedRequest, num_completion_tokens: int, num_cached_tokens: int) -> Usage:
    num_prompt_tokens = prepared.num_prompt_tokens
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


def prompt_logprobs_json(entries: list[TokenLogprobs | None] | None, strings: TokenStrings
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} (None first)."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked: dict[int, tuple[float, int | None]] = {entry.token_id: (clamp_logprob(entry.logprob), None)}
        for rank, (token_id, lp) in enumerate(entry.top, start=1):
            ranked.setdefault(token_id, (clamp_logprob(lp), rank))
        out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": strings.get(t)[0]}
                    for t, (lp, rank) in ranked.items()})
    return out


class ResponseFormat(Protocol):
    """Deltas to one endpoint's response body and stream chunks."""

    def response(self, result: Collected) -> BaseModel: ...

    def start_chunks(self) -> list[BaseModel]: ...

    def chunks(self, delta: Delta) -> list[BaseModel]: ...

    def usage_chunk(self, value: Usage) -> BaseModel: ...
