"""Router test helpers: engines behind `EngineBackend`, spying and scripted backends, a real server.

    EngineUnderTest             a real LLMEngine stepped by an EngineBackend thread, plus a SpyBackend
    SpyBackend(inner)           counts the tokens a backend produced and the aborts it got
    ScriptedBackend(...)        plays fixed chunks / raises / hangs until aborted (error paths)
    serve(app)                  the app on uvicorn at 127.0.0.1:<ephemeral>, in a thread
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from services.router.backend import BackendChunk, BackendRequest, GenerationBackend
from services.router.engine_backend import EngineBackend
from shared.engine.engine import LLMEngine
from shared.errors import BatonError

SMOL = "smollm2-135m"


@dataclass
class EngineUnderTest:
    engine: LLMEngine
    backend: EngineBackend
    spy: SpyBackend

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Every request gone from the engine and every KV block back in the pool."""
        engine = self.engine
        wait_until(lambda: self.backend.num_active_requests == 0 and not engine.has_unfinished()
                   and engine.num_free_kv_blocks == engine.num_kv_blocks, timeout_s,
                   lambda: f"{engine.num_free_kv_blocks}/{engine.num_kv_blocks} blocks free, "
                           f"{self.backend.num_active_requests} active")


@contextlib.contextmanager
def engine_under_test(engine: LLMEngine) -> Iterator[EngineUnderTest]:
    backend = EngineBackend(engine).start()
    under_test = EngineUnderTest(engine, backend, SpyBackend(backend))
    try:
        yield under_test
        under_test.wait_idle()
    finally:
        backend.close()
    engine.check_no_leaks()


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 10.0, describe: Callable[[], str] = lambda: ""
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s {describe()}")
        time.sleep(0.02)


class SpyBackend:
    """Passes everything to `inner`, recording tokens produced and aborts requested per request id."""

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner = inner
        self.num_tokens: dict[str, int] = {}
        self.aborted: list[str] = []

    async def generate(self, req: BackendRequest) -> AsyncIterator[BackendChunk]:
        self.num_tokens[req.request_id] = 0
        async for chunk in self.inner.generate(req):
            self.num_tokens[req.request_id] += len(chunk.token_ids)
            yield chunk

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await self.inner.abort(request_id)

    def healthy(self) -> bool:
        return self.inner.healthy()

    def instance_counts(self) -> dict[str, int]:
        return self.inner.instance_counts()


@dataclass
class ScriptedBackend:
    """Plays `chunks`, then raises `error` (if any), else hangs until aborted (if `hang`)."""

    chunks: list[BackendChunk] = field(default_factory=list)
    error: BaseException | None = None
    hang: bool = False
    is_healthy: bool = True
    requests: list[BackendRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    async def generate(self, req: BackendRequest) -> AsyncIterator[BackendChunk]:
        self.requests.append(req)
        for chunk in self.chunks:
            await asyncio.sleep(0)
            yield chunk
        if self.error is not None:
            raise self.error
        while self.hang and req.request_id not in self.aborted:
            await asyncio.sleep(0.01)
        if self.hang:
            yield BackendChunk([], finished=True, finish_reason="abort")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def healthy(self) -> bool:
        return self.is_healthy

    def instance_counts(self) -> dict[str, int]:
        return {}


def raising(error: BatonError | Exception) -> ScriptedBackend:
    return ScriptedBackend(error=error)


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run `app` on a real uvicorn server on 127.0.0.1 (ephemeral port); yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 10.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10.0)
        sock.close()
