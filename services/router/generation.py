"""From a prepared request to backend tokens and back to text, independent of HTTP.

    PreparedRequest (prompts × n choices) ─GenerationRunner.run─► Delta(index, ...) ... until
    every choice has finished (each choice's last delta carries its finish_reason)

    prompt k ──► backend request `<id>` (one prompt) or `<id>-<k>` ──► chunks with choice i
                 choice index = k * n + i; engine id of one choice: `<backend id>#<i>` (n > 1)

`run` owns the backend requests: whenever it stops before the backend said finished
(the caller went away, an error), it closes the backend streams and calls
`backend.abort` for each request still running, in tasks of their own, so the aborts
happen even while the caller is being cancelled. A stop string that ends one choice
aborts that choice alone (the whole backend request when it has one choice).

Text: each choice has its own incremental detokenizer and stop-string matcher. A stop
token (eos or `stop_token_ids`: the backend finished with "stop") is not part of the
text, as in vLLM, unless `include_stop_str_in_output`; a matched stop string is kept
at the end of the text under the same flag.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from services.router.backend import BackendChunk, BackendRequest, GenerationBackend
from services.router.detokenizer import TextStream
from services.router.metrics import RequestTimer
from shared.engine.request import SamplingParams, TokenLogprobs
from shared.errors import UnavailableError
from shared.multimodal.items import MediaItem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request: one backend request per prompt, `params.n` choices each."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    created: int = field(default_factory=lambda: int(time.time()))
    media: list[list[MediaItem]] = field(default_factory=list)  # each prompt's images and audio (or none)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.params.n]


@dataclass
class Delta:
    """What one backend chunk added to one choice: text safe to show, its tokens and their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # set on the choice's last delta only
    index: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first delta of choice k*n only


@dataclass
class _Choice:
    text: TextStream
    finished: bool = False  # its last delta went out
    backend_finished: bool = False  # the backend sent its last chunk


def _backend_ids(prepared: PreparedRequest) -> list[str]:
    if len(prepared.prompts) == 1:
        return [prepared.request_id]
    return [f"{prepared.request_id}-{k}" for k in range(len(prepared.prompts))]


async def _merged(streams: Sequence[AsyncIterator[BackendChunk]]) -> AsyncGenerator[tuple[int, BackendChunk], None]:
    """(stream number, chunk) from all streams as they come; closing it cancels (closes) them all."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await _close(streams[0])
        return
    queue: asyncio.Queue[tuple[int, BackendChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[BackendChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((k, chunk, None))
        except Exception as e:
            await queue.put((k, None, e))
        else:
            await queue.put((k, None, None))
        finally:
            await _close(stream)

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
                continue
            yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(stream: AsyncIterator[BackendChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class GenerationRunner:
    """Drives one backend for many requests: chunks in, `Delta`s out, aborts when cut short."""

    def __init__(self, backend: GenerationBackend, tokenizer: object, abort_timeout_s: float = 10.0) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.abort_timeout_s = abort_timeout_s
        self._abort_tasks: set[asyncio.Task[None]] = set()

    async def run(self, prepared: PreparedRequest, timer: RequestTimer) -> AsyncGenerator[Delta, None]:
        """Deltas until every choice has finished; raises the backend's BatonErrors."""
        n = prepared.params.n
        ids = _backend_ids(prepared)
        choices = [_Choice(TextStream(self.tokenizer, prepared.stop, skip_special_tokens=prepared.skip_special_tokens))
                   for _ in range(prepared.num_choices)]
        media = prepared.media or [[] for _ in prepared.prompts]
        streams = [self.backend.generate(BackendRequest(rid, prompt, prepared.params, tuple(items)))
                   for rid, prompt, items in zip(ids, prepared.prompts, media, strict=True)]
        num_tokens = 0
        try:
            async with aclosing(_merged(streams)) as merged:
                async for k, chunk in merged:
                    index = k * n + chunk.index
                    choice = choices[index]
                    choice.backend_finished = choice.backend_finished or chunk.finished
                    if choice.finished:  # a stop string ended it; the backend's last words are not shown
                        continue
                    num_tokens += len(chunk.token_ids)
                    timer.on_tokens(len(chunk.token_ids))
                    delta = self._delta(prepared, choice, chunk, index)
                    if delta.finish_reason is not None:
                        choice.finished = True
                        if not choice.backend_finished and n > 1:
                            self._abort_in_background(f"{ids[k]}#{chunk.index}")
                    yield delta
                    if all(c.finished for c in choices):
                        timer.finished()
                        logger.info("request %s: finished after %d tokens in %.3f s", prepared.request_id,
                                    num_tokens, time.monotonic() - timer.start_s)
                        return
            raise UnavailableError("the backend ended the stream without finishing the request")
        finally:
            for k, rid in enumerate(ids):
                if not all(c.backend_finished for c in choices[k * n:(k + 1) * n]):
                    self._abort_in_background(rid)

    @staticmethod
    def _delta(prepared: PreparedRequest, choice: _Choice, chunk: BackendChunk, index: int) -> Delta:
        token_ids = list(chunk.token_ids)
        stop_token = chunk.finished and chunk.finish_reason == "stop" and bool(token_ids)
        shown = token_ids[:-1] if stop_token and not prepared.include_stop_str else token_ids
        piece = choice.text.add(shown)
        finish_reason = "stop" if piece.stopped else None
        if chunk.finished and not piece.stopped:
            tail = choice.text.finish()
            piece.text += tail.text
            finish_reason = "stop" if tail.stopped else chunk.finish_reason or "stop"
        if choice.text.stopped and prepared.include_stop_str:
            piece.text += choice.text.matcher.matched or ""
        return Delta(piece.text, token_ids, list(chunk.logprobs), chunk.num_cached_tokens, finish_reason,
                     index, chunk.prompt_logprobs)

    def _abort_in_background(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(request_id))
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)

    async def _abort(self, request_id: str) -> None:
        try:
            await asyncio.wait_for(self.backend.abort(request_id), self.abort_timeout_s)
            logger.info("request %s: aborted on the backend", request_id)
        except Exception:
            logger.exception("request %s: backend abort failed", request_id)

    async def wait_for_aborts(self) -> None:
        """Let pending aborts finish (tests, shutdown)."""
        while self._abort_tasks:
            await asyncio.gather(*list(self._abort_tasks), return_exceptions=True)
