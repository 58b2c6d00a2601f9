"""`GenerationBackend` over an in-process `LLMEngine` (colocated role): a thin adapter over `AsyncEngine`.

    generate(BackendRequest) ──► AsyncEngine.generate ──► RequestOutput ... ──► BackendChunk ...
    abort(request_id)        ──► AsyncEngine.abort    (a running stream ends with finish_reason "abort")

`AsyncEngine` owns the engine thread, the per-caller asyncio queues and the abort of a
stream left early; this module adds what the router expects on top: refusals (not
running: UnavailableError; duplicate id: InvalidRequestError; over `max_active_requests`:
CapacityError), idempotent start/close and health. An engine step that raises fails the
requests of that step (the router answers 500) and the engine serves on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from types import TracebackType
from typing import cast

from services.router.backend import BackendChunk, BackendRequest
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import LLMEngine
from shared.engine.request import RequestOutput
from shared.errors import CapacityError, InvalidRequestError, RequestAbortedError, UnavailableError


class EngineBackend:
    """Serve a colocated `LLMEngine` to the router. Call `start()` (or use `with`) before use."""

    def __init__(self, engine: LLMEngine, *, max_active_requests: int | None = None) -> None:
        """`max_active_requests`: admitted-but-unfinished requests beyond which `generate` raises
        CapacityError (HTTP 429); None = unbounded (the engine queues them)."""
        self.engine = engine
        self.max_active_requests = max_active_requests
        self.async_engine = AsyncEngine(engine)
        self._active: set[str] = set()  # request ids whose generate() is running
        self._started = False
        self._closed = False

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> EngineBackend:
        if not self._started and not self._closed:
            self.async_engine.start()
            self._started = True
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still running are aborted and their callers get UnavailableError."""
        self._closed = True
        if self._started:
            self.async_engine.stop(timeout_s)

    def __enter__(self) -> EngineBackend:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def healthy(self) -> bool:
        # AsyncEngine has no public liveness flag; its thread dies only on an engine bug outside step()
        return self._started and not self._closed and self.async_engine.running

    def instance_counts(self) -> dict[str, int]:
        return {}  # the engine is in this process

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    # ---- GenerationBackend --------------------------------------------------------------
    async def generate(self, req: BackendRequest) -> AsyncIterator[BackendChunk]:
        if not self.healthy():
            raise UnavailableError("the engine is not running")
        if req.request_id in self._active:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}")
        if self.max_active_requests is not None and len(self._active) >= self.max_active_requests:
            raise CapacityError(f"server is at capacity ({self.max_active_requests} requests in flight)")
        self._active.add(req.request_id)
        try:
            stream = await self.async_engine.generate(req.request_id, req.prompt_token_ids, req.params, media=req.media)
            outputs = cast(AsyncGenerator[RequestOutput, None], stream)  # typed AsyncIterator, is a generator
            async with aclosing(outputs):  # leaving early closes the stream, which aborts the request
                async for out in outputs:
                    yield _chunk(out)
        except RequestAbortedError:  # abort(request_id) while the caller was still listening
            yield BackendChunk([], finished=True, finish_reason="abort")
        finally:
            self._active.discard(req.request_id)

    async def abort(self, request_id: str) -> None:
        if self.healthy():  # a stopped engine has nothing left to abort (and would never answer)
            await self.async_engine.abort(request_id)


def _chunk(out: RequestOutput) -> BackendChunk:
    return BackendChunk(
        token_ids=list(out.new_token_ids),
        logprobs=list(out.new_logprobs),
        finished=out.finished,
        finish_reason=out.finish_reason,
        num_cached_tokens=out.num_cached_tokens,
        index=out.index,
        prompt_logprobs=[None, *out.prompt_logprobs] if out.prompt_logprobs is not None else None,
    )
