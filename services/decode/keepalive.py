"""Keepalive messages on a Generate stream: a sign of life while it has no tokens to send.

Before its first token a stream may wait a long time for good reasons (queued behind others, pulling a
long prompt's KV, computing a migrated request's prompt), so the router cannot take silence there for a
dead instance. With `DecodeRequest.keepalive_s` set, the decode writes a `keepalive` message whenever that
long passes without a write; the router then counts silence as a stall from the stream's start. The
writes come from the event loop, so a stopped or hung process sends none, but one whose compute threads
are busy with a long prompt still does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc.aio

from proto.baton.v1 import decode_pb2

_KEEPALIVE = decode_pb2.DecodeResponse(keepalive=True)


class StreamKeepalive:
    """Writes to `context` for the stream; writes a keepalive whenever `interval_s` passes without one.

    grpc.aio allows one write in flight per call: the stream's writes and the keepalive's share a lock.
    Use as an async context manager: the keepalive task lives exactly as long as the block."""

    def __init__(self, context: grpc.aio.ServicerContext, interval_s: float) -> None:
        self._context = context
        self._interval_s = interval_s
        self._loop = asyncio.get_running_loop()
        self._last_write = self._loop.time()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StreamKeepalive:
        self._task = asyncio.create_task(self._run(), name="decode-keepalive")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def write(self, response: decode_pb2.DecodeResponse) -> None:
        async with self._lock:
            await self._context.write(response)
            self._last_write = self._loop.time()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._last_write + self._interval_s - self._loop.time())
            if self._loop.time() - self._last_write < self._interval_s:
                continue  # a message went out meanwhile: sleep until its own deadline
            try:
                await self.write(_KEEPALIVE)
            except Exception:  # noqa: BLE001 the call is over (cancelled, closed): the stream's own path says so
                return


@contextlib.asynccontextmanager
async def stream_writer(context: grpc.aio.ServicerContext, keepalive_s: float,
                        ) -> AsyncIterator[Callable[[decode_pb2.DecodeResponse], Awaitable[None]]]:
    """The stream's write: `context.write` itself when no keepalive was asked for (0), else a
    StreamKeepalive's for the block's lifetime."""
    if keepalive_s <= 0:
        yield context.write
        return
    async with StreamKeepalive(context, keepalive_s) as keepalive:
        yield keepalive.write
