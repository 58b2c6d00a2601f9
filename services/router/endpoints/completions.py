"""POST /v1/completions: prompts (text or token ids, one or many) to `text_completion` objects.

    prompt: "text" | [ids] | ["text", ...] | [[ids], ...] ──► one backend request per prompt,
    choices indexed k * n + i ──► legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset)

`echo` puts each prompt's text in front of its choices' text (the first chunk of each
choice when streaming); `return_token_ids` adds vLLM's `prompt_token_ids` and `token_ids`
to each choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from services.router.engine_features import PROMPT_LOGPROBS, require
from services.router.generation import Delta, PreparedRequest
from services.router.model_context import ModelContext
from services.router.openai_format import (
    Collected,
    TokenStrings,
    clamp_logprob,
    prompt_logprobs_json,
    usage,
)
from services.router.protocol import CompletionRequest
from services.router.sampling import Asked, check_logprobs, max_tokens, sampling_params, stop_strings
from services.router.shapes import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    Usage,
)
from services.router.structured import grammar_from_body
from shared.engine.request import TokenLogprobs
from shared.errors import InvalidRequestError
from shared.tokenizer import decode, encode_prompt


def _prompts(body: CompletionRequest, model: ModelContext) -> list[list[int]]:
    raw: Any = body.prompt
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        raw = [raw]
    if not raw:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if len(raw) > model.settings.max_prompts:
        raise InvalidRequestError(f"at most {model.settings.max_prompts} prompts per request", param="prompt")
    prompts = []
    for prompt in raw:
        if isinstance(prompt, str):
            token_ids = encode_prompt(model.tokenizer, prompt)
        else:
            token_ids = [int(t) for t in prompt]
            model.check_token_ids(token_ids, "prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        prompts.append(token_ids)
    return prompts


def prepare_completion(body: CompletionRequest, request_id: str, model: ModelContext) -> PreparedRequest:
    if body.best_of not in (None, 1):
        raise InvalidRequestError("only best_of=1 is supported", param="best_of")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        require(PROMPT_LOGPROBS, "echo", "echo with logprobs (the prompt's logprobs)")
    prompts = _prompts(body, model)
    limit = model.settings.max_tokens_limit
    requested = body.max_tokens
    if limit and requested is not None and "max_tokens" not in body.model_fields_set:
        requested = min(requested, limit)  # OpenAI's default of 16, not the client's ask: capped, not refused
    asked = Asked(requested, body.logprobs)
    check_logprobs(asked, model.settings)
    num_tokens = min(max_tokens(asked, len(p), model.max_model_len, limit) for p in prompts)
    params = sampling_params(body, num_tokens, asked.logprobs, model.settings, model.defaults, model.vocab_size)
    structured = grammar_from_body(body)
    if structured is not None:
        params = replace(params, structured=structured)
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens carry their logprobs too
        params = replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, body.logprobs))
    return PreparedRequest(
        request_id=request_id, prompts=prompts, params=params, stop=stop_strings(body, model.settings),
        stream=bool(body.stream),
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        include_stop_str=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
    )


class CompletionFormat:
    """/v1/completions: `text_completion` objects, legacy logprobs (tokens, token_logprobs, ...)."""

    def __init__(self, prepared: PreparedRequest, body: CompletionRequest, model: ModelContext,
                 strings: TokenStrings) -> None:
        self.prepared = prepared
        self.model_name = model.name
        self.strings = strings
        self.wants_logprobs = prepared.params.logprobs is not None
        self.return_token_ids = body.return_token_ids
        self.echo = [decode(model.tokenizer, p) for p in prepared.prompts] if body.echo else None
        self.show_prompt_logprobs = body.prompt_logprobs is not None
        self._prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}  # by prompt, once known
        self._text_offsets: dict[int, int] = {}
        self._started: set[int] = set()

    def _head(self) -> dict[str, Any]:
        return {"id": self.prepared.request_id, "created": self.prepared.created, "model": self.model_name}

    def _echo(self, index: int) -> str:
        return self.echo[index // self.prepared.params.n] if self.echo is not None else ""

    def _logprobs(self, index: int, entries: Sequence[TokenLogprobs]) -> CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        out = CompletionLogprobs()
        if self.echo is not None and index not in self._text_offsets:
            self._text_offsets[index] = self._echo_logprobs(index, out)
        offset = self._text_offsets.get(index, len(self._echo(index)))
        for entry in entries:
            text = self.strings.get(entry.token_id)[0]
            top = {self.strings.get(t)[0]: clamp_logprob(lp) for t, lp in entry.top}
            top.setdefault(text, clamp_logprob(entry.logprob))  # vLLM: the chosen token is always listed
            out.tokens.append(text)
            out.token_logprobs.append(clamp_logprob(entry.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return out

    def _echo_logprobs(self, index: int, out: CompletionLogprobs) -> int:
        """The echoed prompt's tokens (its first one has no logprob, as in OpenAI's API); their text's length."""
        prompt = self.prepared.prompt_of(index)
        entries = self._prompt_logprobs.get(index // self.prepared.params.n) or [None] * len(prompt)
        offset = 0
        for token_id, entry in zip(prompt, entries, strict=True):
            text = self.strings.get(token_id)[0]
            out.tokens.append(text)
            out.token_logprobs.append(clamp_logprob(entry.logprob) if entry is not None else None)
            out.top_logprobs.append({self.strings.get(t)[0]: clamp_logprob(lp) for t, lp in entry.top}
                                    if entry is not None else None)
            out.text_offset.append(offset)
            offset += len(text)
        return offset

    def _record_prompt_logprobs(self, index: int, entries: list[TokenLogprobs | None] | None) -> dict[str, Any]:
        """Keep a prompt's logprobs for echo; the `prompt_logprobs` field when the request asked for it."""
        if entries is not None:
            self._prompt_logprobs[index // self.prepared.params.n] = entries
        if not self.show_prompt_logprobs:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(entries, self.strings)}

    def _ids(self, index: int, token_ids: list[int], first: bool) -> dict[str, Any]:
        if not self.return_token_ids:
            return {}
        ids: dict[str, Any] = {"token_ids": token_ids}
        if first:
            ids["prompt_token_ids"] = self.prepared.prompt_of(index)
        return ids

    def response(self, result: Collected) -> BaseModel:
        choices = []
        fields = {index: self._record_prompt_logprobs(index, c.prompt_logprobs) for index, c in result.in_order()}
        for index, c in result.in_order():
            choices.append(CompletionChoice(
                index=index, text=self._echo(index) + c.text, logprobs=self._logprobs(index, c.logprobs),
                finish_reason=c.finish_reason, **fields[index], **self._ids(index, c.token_ids, True)))
        return Completion(**self._head(), choices=choices,
                          usage=usage(self.prepared, result.num_tokens, result.num_cached_tokens))

    def start_chunks(self) -> list[BaseModel]:
        return []

    def chunks(self, delta: Delta) -> list[BaseModel]:
        index = delta.index
        first = index not in self._started
        self._started.add(index)
        text = (self._echo(index) if first else "") + delta.text
        out: list[BaseModel] = []
        fields = self._record_prompt_logprobs(index, delta.prompt_logprobs)
        if text or (self.wants_logprobs and delta.logprobs) or (self.return_token_ids and delta.token_ids):
            choice = CompletionChoice(
                index=index, text=text, logprobs=self._logprobs(index, delta.logprobs), **fields,
                **self._ids(index, delta.token_ids, first))
            out.append(CompletionChunk(**self._head(), choices=[choice]))
        if delta.finish_reason is not None:
            out.append(CompletionChunk(**self._head(), choices=[
                CompletionChoice(index=index, text="", finish_reason=delta.finish_reason)]))
        return out

    def usage_chunk(self, value: Usage) -> BaseModel:
        return CompletionChunk(**self._head(), choices=[], usage=value)
