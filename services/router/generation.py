"""From an OpenAI request body to backend tokens and back to text, independent of HTTP.

    body ─prepare_completion / prepare_chat─► PreparedRequest (validated, tokenized)
         ─GenerationRunner.run─► Delta ... (text that is safe to show, tokens, logprobs;
                                 the last one carries finish_reason)

`run` owns the backend request: whenever it stops before the backend said finished
(a stop string matched, the caller went away, an error), it closes the backend stream
and calls `backend.abort(request_id)` in a task of its own, so the abort happens even
while the caller is being cancelled.

Context length follows vLLM: a prompt of max_model_len tokens or more is refused; an
explicit max_tokens that does not fit beside the prompt is refused (400,
context_length_exceeded); an absent one (null) means "up to the end of the context".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.router.backend import BackendRequest, GenerationBackend
from services.router.detokenizer import TextStream
from services.router.metrics import RequestTimer
from services.router.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from services.router.settings import RouterSettings
from shared.engine.request import SamplingParams, TokenLogprobs
from shared.errors import ContextLengthExceededError, InvalidRequestError, UnavailableError
from shared.tokenizer import encode_chat, encode_prompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Delta:
    """What one backend chunk added: text safe to show, its tokens and their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # set on the last delta only


def _unsupported(body: SamplingRequest) -> None:
    """Refuse, with a clear 400, what this server would otherwise silently ignore."""
    if body.n not in (None, 1):
        raise InvalidRequestError("only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0.0):
            raise InvalidRequestError(f"{name} is not supported (only 0)", param=name)
    if body.repetition_penalty not in (None, 1.0):
        raise InvalidRequestError("repetition_penalty is not supported (only 1)", param="repetition_penalty")
    if body.logit_bias:
        raise InvalidRequestError("logit_bias is not supported", param="logit_bias")


def _stop_strings(body: SamplingRequest, settings: RouterSettings) -> tuple[str, ...]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > settings.max_stop_strings:
        raise InvalidRequestError(f"at most {settings.max_stop_strings} stop strings are allowed", param="stop")
    for s in stop:
        if not s or len(s) > settings.max_stop_string_chars:
            raise InvalidRequestError(
                f"stop strings must have 1 to {settings.max_stop_string_chars} characters", param="stop"
            )
    return tuple(dict.fromkeys(stop))


def _max_tokens(asked: _Asked, num_prompt_tokens: int, max_model_len: int) -> int:
    requested = asked.max_tokens
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, and at least one token must be generated. Please shorten the prompt.",
            param=asked.prompt_param,
        )
    if requested is None:
        return max_model_len - num_prompt_tokens
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


def _sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
    )


def _check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    if any(t < 0 or t >= vocab_size for t in token_ids):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size})", param=param)


@dataclass(frozen=True)
class _Asked:
    """What the body asked for, and under which field names (for errors)."""

    max_tokens: int | None
    logprobs: int | None
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    logprobs_param: str = "logprobs"


def _finish_prepare(
    body: SamplingRequest, request_id: str, prompt: list[int], asked: _Asked, settings: RouterSettings
) -> PreparedRequest:
    if asked.logprobs is not None and not 0 <= asked.logprobs <= settings.max_logprobs:
        raise InvalidRequestError(f"{asked.logprobs_param} must be in [0, {settings.max_logprobs}]",
                                  param=asked.logprobs_param)
    max_tokens = _max_tokens(asked, len(prompt), settings.max_model_len)
    return PreparedRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=_sampling_params(body, max_tokens, asked.logprobs),
        stop=_stop_strings(body, settings),
        stream=bool(body.stream),
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
    )


def prepare_completion(
    body: CompletionRequest, request_id: str, tokenizer: Any, settings: RouterSettings
) -> PreparedRequest:
    _unsupported(body)
    if body.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    if body.best_of not in (None, 1):
        raise InvalidRequestError("only best_of=1 is supported", param="best_of")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidRequestError("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        token_ids = encode_prompt(tokenizer, prompt)
    else:
        token_ids = [int(t) for t in prompt]
        _check_token_ids(token_ids, len(tokenizer), "prompt")
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return _finish_prepare(body, request_id, token_ids, _Asked(body.max_tokens, body.logprobs), settings)


def _message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not body.messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    messages = []
    for message in body.messages:
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequestError("only text content parts are supported", param="messages")
            content = "\n".join(part.text or "" for part in content)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name:
            entry["name"] = message.name
        messages.append(entry)
    return messages


def prepare_chat(
    body: ChatCompletionRequest, request_id: str, tokenizer: Any, settings: RouterSettings
) -> PreparedRequest:
    _unsupported(body)
    if body.tools:
        raise InvalidRequestError("tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise InvalidRequestError("only response_format type 'text' is supported", param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    token_ids = encode_chat(tokenizer, _message_dicts(body))
    if not token_ids:
        raise InvalidRequestError("the rendered conversation is empty", param="messages")
    by_new_name = body.max_completion_tokens is not None
    asked = _Asked(
        max_tokens=body.max_completion_tokens if by_new_name else body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_param="messages",
        max_tokens_param="max_completion_tokens" if by_new_name else "max_tokens",
        logprobs_param="top_logprobs",
    )
    return _finish_prepare(body, request_id, token_ids, asked, settings)


class GenerationRunner:
    """Drives one backend for many requests: chunks in, `Delta`s out, aborts when cut short."""

    def __init__(self, backend: GenerationBackend, tokenizer: Any, abort_timeout_s: float = 10.0) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.abort_timeout_s = abort_timeout_s
        self._abort_tasks: set[asyncio.Task[None]] = set()

    async def run(self, prepared: PreparedRequest, timer: RequestTimer) -> AsyncGenerator[Delta, None]:
        """Deltas until one has finish_reason; raises the backend's BatonErrors."""
        request = BackendRequest(prepared.request_id, prepared.prompt_token_ids, prepared.params)
        text = TextStream(self.tokenizer, prepared.stop)
        chunks = self.backend.generate(request)
        backend_done = False
        num_tokens = 0
        try:
            async for chunk in chunks:
                backend_done = chunk.finished
                num_tokens += len(chunk.token_ids)
                timer.on_tokens(len(chunk.token_ids))
                piece = text.add(chunk.token_ids)
                finish_reason = "stop" if piece.stopped else None
                if chunk.finished and not piece.stopped:
                    tail = text.finish()
                    piece.text += tail.text
                    finish_reason = "stop" if tail.stopped else chunk.finish_reason or "stop"
                if finish_reason is not None:
                    timer.finished()
                    logger.info("request %s: finished (%s) after %d tokens in %.3f s", prepared.request_id,
                                finish_reason, num_tokens, time.monotonic() - timer.start_s)
                yield Delta(piece.text, list(chunk.token_ids), list(chunk.logprobs), chunk.num_cached_tokens,
                            finish_reason)
                if finish_reason is not None:
                    return
            raise UnavailableError("the backend ended the stream without finishing the request")
        finally:
            if not backend_done:
                self._abort_in_background(chunks, prepared.request_id)

    def _abort_in_background(self, chunks: AsyncIterator[Any], request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(chunks, request_id))
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)

    async def _abort(self, chunks: AsyncIterator[Any], request_id: str) -> None:
        try:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
            await asyncio.wait_for(self.backend.abort(request_id), self.abort_timeout_s)
            logger.info("request %s: aborted on the backend", request_id)
        except Exception:
            logger.exception("request %s: backend abort failed", request_id)

    async def wait_for_aborts(self) -> None:
        """Let pending aborts finish (tests, shutdown)."""
        while self._abort_tasks:
            await asyncio.gather(*list(self._abort_tasks), return_exceptions=True)
