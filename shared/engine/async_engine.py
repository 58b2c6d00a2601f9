"""An engine on its own thread, served to asyncio callers.

    asyncio callers ──commands (add / handoff / abort)──► engine thread
         ▲                                                  │ step() in a loop
         └──── per-request asyncio.Queue ◄── outputs ───────┘ (call_soon_threadsafe)

One thread owns the `LLMEngine`; nothing else touches it. A caller's stream
ends with a finished output (with n > 1 choices, one per choice, each with its
index), or raises the error that ended it. Leaving a stream early (client gone,
task cancelled) aborts the request, which frees its blocks on the engine thread
exactly once; aborting one choice by its own id ends that choice with "abort".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shared.engine.choices import FirstToken
from shared.engine.core_share import CoreShare
from shared.engine.engine import LLMEngine
from shared.engine.handoff import KVHandoff
from shared.engine.request import RequestOutput, SamplingParams
from shared.errors import BatonError, RequestAbortedError, UnavailableError
from shared.kv.remote import AgentAddress, ClaimedHandoff, HandoffSlots
from shared.multimodal.items import MediaItem
from shared.registry.kv_summary import MAX_SUMMARY_BLOCKS

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


_CACHED_HASHES_EVERY_S = 0.2  # how often the engine thread refreshes the prefix hashes it publishes


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    # chained hashes of the prefix blocks its cache holds, most recently cached first (refreshed every
    # _CACHED_HASHES_EVERY_S, at most MAX_SUMMARY_BLOCKS): where a router expects prefix hits
    cached_block_hashes: tuple[bytes, ...] = ()


class _Stream:
    """Where one request's outputs go: an asyncio queue on the caller's loop.

    With a stream interval above 1 a choice's tokens are held on the engine thread until that many are out
    (its first output and its last go at once), so the caller's loop, the service's gRPC stream and the
    router each handle one message per `interval` tokens rather than one per step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, num_choices: int, interval: int = 1) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.num_open = num_choices  # choices not finished yet (engine thread's count)
        self.finished = False
        self.interval = interval
        self._held: dict[int, RequestOutput] = {}  # by choice index: tokens not sent yet
        self._started: set[int] = set()  # choices whose first output went

    def send(self, out: RequestOutput) -> None:
        """Put `out`, or hold it while its choice has fewer than `interval` tokens waiting (engine thread)."""
        if self.interval > 1:
            held = self._held.pop(out.index, None)
            if held is not None:
                out = held.followed_by(out)
            if not (out.finished or out.index not in self._started or len(out.new_token_ids) >= self.interval):
                self._held[out.index] = out
                return
            self._started.add(out.index)
        self.put(out)

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, cores: CoreShare | None = None) -> None:
        self.engine = engine
        self.cores = cores  # engines of one host lending each other their cores (shared/engine/core_share.py)
        if cores is not None:  # on the thread that runs the step's kernels (the engine's, or the executor's)
            engine.before_step = engine.between_layers = cores.fit_threads
            engine.after_step = cores.step_over
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._stop = threading.Event()
        self._load = EngineLoad(0, 0, engine.num_kv_blocks, engine.num_free_kv_blocks)
        self._hashes_due_s = 0.0  # time.monotonic() at which the published prefix hashes are next refreshed
        self.num_steps = 0

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort everything in flight and stop the thread."""
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def load(self) -> EngineLoad:
        return self._load

    @property
    def running(self) -> bool:
        """The engine thread is alive and not stopping."""
        return self._thread.is_alive() and not self._stop.is_set()

    # ---- requests ------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        output_token_ids: Sequence[int] = (), media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has `finished` set. `output_token_ids`: a migrated
        request's output so far (Engine.add_request); only the tokens after them are streamed. `media`: the
        prompt's images and audio (encoded on the engine thread when the request is added)."""
        return self._run(request_id, params, lambda: self.engine.add_request(
            request_id, prompt_token_ids, params, output_token_ids, media=media))

    async def generate_from_handoff(
        self, request_id: str, params: SamplingParams, handoff: KVHandoff
    ) -> AsyncIterator[RequestOutput]:
        """Continue a request prefilled elsewhere (decode role)."""

        def admit() -> None:
            done = self.engine.add_handoff(request_id, params, handoff)
            if done is not None:  # the first token already ended it
                self._deliver([done])

        return self._run(request_id, params, admit)

    async def generate_pushed(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, address: AgentAddress,
        slots: HandoffSlots, media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Prefill through kv_transfer: the final output's `handoff` is the push's `PushOutcome`."""
        return self._run(request_id, params, lambda: self.engine.add_pushed_request(
            request_id, prompt_token_ids, params, address, slots, media=media))

    async def generate_pulled(
        self, request_id: str, params: SamplingParams, claimed: ClaimedHandoff, address: AgentAddress,
        more_choices: Sequence[FirstToken] = (), media: Sequence[MediaItem] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Continue a request whose KV waits in kv_transfer (decode role); the stream fails if the pull does.

        `more_choices`: with params.n > 1, what prefill sampled for choices 1..n-1. `media`: the prompt's."""

        def admit() -> None:
            self._deliver(self.engine.add_pulled_handoff(request_id, params, claimed, address, more_choices, media))

        return self._run(request_id, params, admit)

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda: self._abort_now(request_id))

    def _run(self, request_id: str, params: SamplingParams, admit: Callable[[], None]
             ) -> AsyncIterator[RequestOutput]:
        if self._stop.is_set():
            raise UnavailableError("engine is shutting down")
        interval = max(params.stream_interval or 1, self.engine.config.stream_interval)
        stream = _Stream(asyncio.get_running_loop(), params.n, interval)

        def add() -> None:
            if request_id in self._streams:
                raise RequestAbortedError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
            try:
                admit()
            except BaseException:
                del self._streams[request_id]
                raise

        return self._consume(request_id, stream, params, add)

    async def _consume(
        self, request_id: str, stream: _Stream, params: SamplingParams, add: Callable[[], None]
    ) -> AsyncIterator[RequestOutput]:
        if params.structured is not None:  # compiling takes a while: here, off the engine thread
            await asyncio.to_thread(self.engine.prepare, params)
        try:
            await self._call(add)  # raises the engine's validation error, if any
        except asyncio.CancelledError:
            # the caller left while the add was queued: the engine thread still runs it (commands run in
            # order), so the abort queued after it frees what it took
            self._commands.put((lambda: self._abort_now(request_id), concurrent.futures.Future()))
            raise
        try:
            num_open = params.n
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                num_open -= item.finished
                stream.finished = num_open == 0  # before the yield: a consumer may stop once it has the last
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                logger.info("request %s: stream left early, aborting", request_id)
                self._commands.put((lambda: self._abort_now(request_id), concurrent.futures.Future()))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread; its result or exception comes back here."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if not self.running:
            raise UnavailableError("engine is not running")
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    # ---- the engine thread ---------------------------------------------------------------
    def _abort_now(self, request_id: str) -> bool:
        choice = self.engine.choices.parent_of(request_id)
        if choice is not None:  # one choice of an n > 1 request: it ends, its siblings go on
            found = self.engine.abort(request_id)
            if found:
                parent, index = choice
                self._deliver([RequestOutput(parent, [], [], True, "abort", 0, 0, index=index)])
            return found
        stream = self._streams.pop(request_id, None)
        found = self.engine.abort(request_id)
        if stream is not None and not stream.finished:
            stream.put(RequestAbortedError(f"request {request_id} aborted"))
        return found

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.num_open -= 1
                if stream.num_open == 0:
                    del self._streams[out.request_id]
            stream.send(out)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished()
                if idle and self.cores is not None:
                    self.cores.set_busy(False)  # lends this engine's cores while it waits
                self._drain_commands(block=idle)
                if self.engine.has_unfinished():
                    if self.cores is not None:
                        self.cores.set_busy(True)  # the step's thread fits its count (engine.before_step)
                    self._step()
                self._publish_load()
        except BaseException:
            logger.exception("engine thread died")
            raise
        finally:
            self._stop.set()
            self._fail_all(UnavailableError("engine stopped"))
            self._fail_pending_commands()
            if self.engine.remote is not None:
                self.engine.remote.close()  # transports are driven by this thread: closed here too
            self.engine.close()
            if self.cores is not None:
                self.cores.close()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # an engine bug must not hang every caller
            logger.exception("engine step failed; failing all requests in flight")
            self._fail_all(BatonError(f"engine step failed: {type(e).__name__}"))
            return
        self.num_steps += 1
        self._deliver(outputs)
        for request_id, error in self.engine.take_failures():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            # a command runs even when its caller has left (an abort must): its result then goes nowhere,
            # and must not kill this thread (setting a cancelled future raises)
            try:
                result = fn()
            except BaseException as e:  # delivered to the caller, not swallowed
                _settle(future, exception=e)
            else:
                _settle(future, result=result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending_commands(self) -> None:
        """Commands that arrived as the thread stopped: refuse them rather than leave callers waiting."""
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            _settle(future, exception=UnavailableError("engine stopped"))

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            try:
                self.engine.abort(request_id)
            finally:
                self._streams.pop(request_id).put(error)

    def _publish_load(self) -> None:
        sched = self.engine.scheduler
        hashes = self._load.cached_block_hashes
        now = time.monotonic()
        if now >= self._hashes_due_s:  # read here, on the engine thread that changes the pool
            self._hashes_due_s = now + _CACHED_HASHES_EVERY_S
            hashes = tuple(self.engine.pool.recent_cached_hashes(MAX_SUMMARY_BLOCKS))
        self._load = EngineLoad(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting + self.engine.num_pending_handoffs,
            num_kv_blocks_total=self.engine.num_kv_blocks,
            num_kv_blocks_free=self.engine.num_free_kv_blocks,
            cached_block_hashes=hashes,
        )


def _settle(future: concurrent.futures.Future[Any], result: Any = None, exception: BaseException | None = None) -> None:
    """Hand a command's outcome to its caller, unless the caller cancelled (then it is dropped, logged)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        if exception is not None:
            logger.info("a command whose caller left failed: %r", exception)
