"""Deltas to OpenAI's response and stream-chunk shapes, for completions and chat.

Streams, both kinds:   [chat: role chunk] → content chunks → finish chunk (empty delta/text,
finish_reason) → [usage chunk: choices [] when stream_options.include_usage] → [DONE].
Logprobs travel with the chunk of the tokens they belong to; text may lag its tokens
(held back while a character or a possible stop string is incomplete).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from services.router.generation import Delta, PreparedRequest
from services.router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatStreamChoice,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    DeltaMessage,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from shared.engine.request import TokenLogprobs
from shared.tokenizer import token_bytes

MIN_LOGPROB = -9999.0  # what OpenAI reports for -inf


@dataclass
class Collected:
    """A whole (non-streamed) generation."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.num_tokens += len(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.finish_reason = delta.finish_reason or self.finish_reason


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


def _logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def usage(prepared: PreparedRequest, num_completion_tokens: int, num_cached_tokens: int) -> Usage:
    num_prompt_tokens = len(prepared.prompt_token_ids)
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


class _Format:
    def __init__(self, prepared: PreparedRequest, model_name: str, strings: TokenStrings) -> None:
        self.prepared = prepared
        self.model_name = model_name
        self.strings = strings
        self.wants_logprobs = prepared.params.logprobs is not None

    def _head(self) -> dict[str, Any]:
        return {"id": self.prepared.request_id, "created": self.prepared.created, "model": self.model_name}


class CompletionFormat(_Format):
    """/v1/completions: `text_completion` objects, legacy logprobs (tokens, token_logprobs, ...)."""

    def __init__(self, prepared: PreparedRequest, model_name: str, strings: TokenStrings) -> None:
        super().__init__(prepared, model_name, strings)
        self._text_offset = 0

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        out = CompletionLogprobs()
        for entry in entries:
            text = self.strings.get(entry.token_id)[0]
            top = {self.strings.get(t)[0]: _logprob(lp) for t, lp in entry.top}
            top.setdefault(text, _logprob(entry.logprob))  # vLLM: the chosen token is always listed
            out.tokens.append(text)
            out.token_logprobs.append(_logprob(entry.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(self._text_offset)
            self._text_offset += len(text)
        return out

    def response(self, result: Collected) -> Completion:
        choice = CompletionChoice(text=result.text, logprobs=self._logprobs(result.logprobs),
                                  finish_reason=result.finish_reason)
        return Completion(**self._head(), choices=[choice],
                          usage=usage(self.prepared, result.num_tokens, result.num_cached_tokens))

    def start_chunks(self) -> list[BaseModel]:
        return []

    def chunks(self, delta: Delta) -> list[BaseModel]:
        out: list[BaseModel] = []
        if delta.text or (self.wants_logprobs and delta.logprobs):
            choice = CompletionChoice(text=delta.text, logprobs=self._logprobs(delta.logprobs))
            out.append(CompletionChunk(**self._head(), choices=[choice]))
        if delta.finish_reason is not None:
            out.append(CompletionChunk(**self._head(), choices=[
                CompletionChoice(text="", finish_reason=delta.finish_reason)]))
        return out

    def usage_chunk(self, value: Usage) -> BaseModel:
        return CompletionChunk(**self._head(), choices=[], usage=value)


class ChatFormat(_Format):
    """/v1/chat/completions: `chat.completion[.chunk]` objects, `logprobs.content[]` entries."""

    def _entry(self, entry: TokenLogprobs) -> TokenLogprob:
        text, raw = self.strings.get(entry.token_id)
        top = []
        for token_id, lp in entry.top:
            top_text, top_raw = self.strings.get(token_id)
            top.append(TopLogprob(token=top_text, logprob=_logprob(lp), bytes=top_raw))
        return TokenLogprob(token=text, logprob=_logprob(entry.logprob), bytes=raw, top_logprobs=top)

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs | None:
        if not self.wants_logprobs:
            return None
        return ChatLogprobs(content=[self._entry(e) for e in entries])

    def response(self, result: Collected) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=result.text), logprobs=self._logprobs(result.logprobs),
                            finish_reason=result.finish_reason)
        return ChatCompletion(**self._head(), choices=[choice],
                              usage=usage(self.prepared, result.num_tokens, result.num_cached_tokens))

    def start_chunks(self) -> list[BaseModel]:
        choice = ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))
        return [ChatCompletionChunk(**self._head(), choices=[choice])]

    def chunks(self, delta: Delta) -> list[BaseModel]:
        out: list[BaseModel] = []
        if delta.text or (self.wants_logprobs and delta.logprobs):
            choice = ChatStreamChoice(delta=DeltaMessage(content=delta.text), logprobs=self._logprobs(delta.logprobs))
            out.append(ChatCompletionChunk(**self._head(), choices=[choice]))
        if delta.finish_reason is not None:
            out.append(ChatCompletionChunk(**self._head(), choices=[
                ChatStreamChoice(delta=DeltaMessage(), finish_reason=delta.finish_reason)]))
        return out

    def usage_chunk(self, value: Usage) -> BaseModel:
        return ChatCompletionChunk(**self._head(), choices=[], usage=value)


ResponseFormat = CompletionFormat | ChatFormat
