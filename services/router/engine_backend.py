"""`GenerationBackend` over an in-process `LLMEngine` (colocated role), stepped by one thread.

    event loop(s)                                  engine thread (the only code touching the engine)
    generate() ─ _Add(request, sink) ──► commands ──► engine.add_request
    abort()    ─ _Abort(request_id)  ──►  (queue)  ──► engine.abort
                                                     loop: drain commands, engine.step()
    sink.queue ◄─ loop.call_soon_threadsafe(put) ◄─── RequestOutput -> BackendChunk

Each request owns a sink: its caller's event loop plus an asyncio queue, so callers on
different loops (a test's loop, uvicorn's) share one engine. A request leaves the
sink table exactly once: when it finishes, when it is aborted, or when the engine fails;
whoever stops iterating `generate` early leaves an abort behind, so blocks always return.
The thread sleeps on the command queue while the engine is idle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType

from services.router.backend import BackendChunk, BackendRequest
from shared.engine.engine import LLMEngine
from shared.engine.request import RequestOutput
from shared.errors import BatonError, CapacityError, InvalidRequestError, UnavailableError

logger = logging.getLogger(__name__)

_SinkItem = BackendChunk | BaseException


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_SinkItem]

    def deliver(self, item: _SinkItem) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    request: BackendRequest
    sink: _Sink


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class EngineBackend:
    """Serve a colocated `LLMEngine` to the router. Call `start()` (or use `with`) before use."""

    def __init__(self, engine: LLMEngine, *, max_active_requests: int | None = None) -> None:
        """`max_active_requests`: admitted-but-unfinished requests beyond which `generate` raises
        CapacityError (HTTP 429); None = unbounded (the engine queues them)."""
        self.engine = engine
        self.max_active_requests = max_active_requests
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._active: set[str] = set()  # request ids whose generate() is running (event-loop side)
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._failed = False

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> EngineBackend:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still running are aborted and their callers get UnavailableError."""
        self._stopped = True
        if self._thread is not None:
            self._commands.put(_Stop())
            self._thread.join(timeout_s)

    def __enter__(self) -> EngineBackend:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def healthy(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopped and not self._failed

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
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._active.add(req.request_id)
        self._commands.put(_Add(req, sink))
        done = False
        try:
            while not done:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            self._active.discard(req.request_id)
            if not done:  # the caller stopped early (cancelled, disconnected, stop string)
                self._commands.put(_Abort(req.request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
        except BaseException:
            self._failed = True
            logger.exception("engine thread died")
        finally:
            self._fail_all(UnavailableError("the engine stopped"))
            self._refuse_queued()

    def _drain_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when idle). False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command.request, command.sink)
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, req: BackendRequest, sink: _Sink) -> None:
        try:
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.params)
        except BatonError as e:
            sink.deliver(e)
            return
        except Exception as e:
            logger.exception("request %s: engine refused it unexpectedly", req.request_id)
            sink.deliver(e)
            return
        self._sinks[req.request_id] = sink

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            logger.debug("request %s: aborted", request_id)
            sink.deliver(BackendChunk([], finished=True, finish_reason="abort"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # the engine's state for these requests is suspect: drop them all, keep serving new ones
            logger.exception("engine step failed; failing %d requests", len(self._sinks))
            self._fail_all(BatonError(f"engine step failed: {type(e).__name__}"))
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:  # aborted while the step ran
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink.deliver(_chunk(out))

    def _fail_all(self, error: BatonError) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("request %s: abort failed", request_id)
            sink.deliver(error)
        self._sinks.clear()


    def _refuse_queued(self) -> None:
        """After the loop ends: requests that were queued behind the stop get an error, not a hang."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.sink.deliver(UnavailableError("the engine stopped"))


def _chunk(out: RequestOutput) -> BackendChunk:
    return BackendChunk(
        token_ids=list(out.new_token_ids),
        logprobs=list(out.new_logprobs),
        finished=out.finished,
        finish_reason=out.finish_reason,
        num_cached_tokens=out.num_cached_tokens,
    )
