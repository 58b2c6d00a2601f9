"""Request migration: a decode stream that breaks goes on from another instance, the client seeing no seam.

```
 decode A streams t1 t2 t3 ──► client
     │ A dies (UNAVAILABLE, INTERNAL, a lost handoff, ...) or is silent (not even a keepalive) for stall_timeout_s
     ▼
 migrations < limit and n == 1?
     yes ──► decode B: Generate(prompt, output_token_ids=[t1 t2 t3], no handoff)
     │         B computes prompt + t1..t3 as a preempted request's tokens (its prefix cache and the grammar,
     │         penalties and max_tokens all count them as output) and streams t4 ... ──► client
     no ───► the error, to the client (a clear 503 or the failure's own status)
```

Greedy output after a migration equals the run with no fault: B's next token follows the same tokens.
What the client saw is never sent again, and nothing is skipped: the router counts every token it
forwarded. A prefill that fails before the first token is retried on another prefill (grpc_backend.py)
and, past its attempts, migrates the same way with no tokens yet: a decode computes the prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio

from proto.baton.v1 import decode_pb2
from shared.errors import UnavailableError
from shared.grpc_common import PEER_KEEPALIVE_S

# the instance or its transport failed, not the request: worth going on elsewhere. CANCELLED comes from the
# server only (an engine stopped under the request); the router's own cancel is a CancelledError.
MIGRATABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.NOT_FOUND,  # the handoff is gone (its kv_transfer restarted): the tokens are not
})


@dataclass(frozen=True)
class MigrationPolicy:
    """`limit`: moves one request may make (0 = never migrate); `stall_timeout_s`: a stream silent this
    long counts as dead (0 = wait forever; the decode sends keepalives while it has no token to send, as
    a stream may be queued or computing a long prompt before its first: keepalive.py); `wait_s`: how long
    a request whose instances all failed waits for a new one to register (a restart) before its error."""

    limit: int = 3
    stall_timeout_s: float = 30.0
    wait_s: float = 15.0


class DecodeStalledError(UnavailableError):
    """A decode stream went silent mid-generation; the router treats the instance as dead."""


class _StallWatch:
    """Cancels `task` when one read has waited `stall_timeout_s`: one timer per timeout period, not per message.

    The per-message alternative, `asyncio.wait_for` around each read, costs a Task, a timer and an extra
    event-loop turn for every token (Python 3.11), on the router's one core of CPU per stream."""

    def __init__(self, task: asyncio.Task[object], stall_timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = task
        self._timeout_s = stall_timeout_s
        self._read_since: float | None = None  # when the read in progress began; None between reads
        self._handle: asyncio.TimerHandle | None = None
        self.fired = False

    def reading(self) -> None:
        self._read_since = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self._read_since + self._timeout_s, self._check)

    def read_done(self) -> None:
        self._read_since = None

    def _check(self) -> None:
        since = self._read_since
        if since is None:  # between reads: the next read arms the timer again
            self._handle = None
        elif self._loop.time() - since >= self._timeout_s:
            self._handle = None
            self.fired = True
            self._task.cancel()
        else:  # the read in progress began after the timer was set: wait for its own deadline
            self._handle = self._loop.call_at(since + self._timeout_s, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def keepalive_s(stall_timeout_s: float) -> float:
    """What a Generate call asks its decode for (DecodeRequest.keepalive_s): a sign of life three times
    per stall timeout, so that one late message is not yet a stall; 0 (none) without a stall rule."""
    return stall_timeout_s / 3


def ping_interval_s(stall_timeout_s: float) -> float:
    """How often the router's channels ping their peers while a call is open, each ping given as long to be
    answered (grpc_common.keepalive_options): an instance that answers nothing for about a stall timeout is
    dead whatever call waits on it, a Prefill too (a unary call has no stream to send keepalives on)."""
    return stall_timeout_s / 2 if stall_timeout_s > 0 else PEER_KEEPALIVE_S


async def read_stream(call: grpc.aio.UnaryStreamCall, stall_timeout_s: float, keepalive: bool = False,
                      ) -> AsyncIterator[decode_pb2.DecodeResponse]:
    """The stream's messages, keepalives left out; DecodeStalledError (the call cancelled) when one is
    late: any message past the first, or with `keepalive` (the call asked for keepalives) the first too."""
    task = asyncio.current_task()
    watch = _StallWatch(task, stall_timeout_s) if keepalive and stall_timeout_s > 0 and task is not None else None
    try:
        while True:
            if watch is not None:
                watch.reading()
            try:
                msg = await call.read()
            except asyncio.CancelledError:
                if watch is not None and watch.fired and task is not None and task.uncancel() == 0:
                    raise DecodeStalledError(f"decode stream silent for {stall_timeout_s:g} s") from None
                raise
            if msg is grpc.aio.EOF:
                return
            if watch is not None:
                watch.read_done()
            elif stall_timeout_s > 0 and task is not None:  # silence counts from the first message on
                watch = _StallWatch(task, stall_timeout_s)
            if not msg.keepalive:
                yield msg
    finally:
        if watch is not None:
            watch.stop()
        call.cancel()  # no-op on a finished call; stops a stalled or abandoned one


def resumed_message(message: decode_pb2.DecodeRequest, emitted: list[int],
                    keep_prompt_logprobs: bool) -> decode_pb2.DecodeRequest:
    """`message` for another decode instance: no handoff (it computes the prompt), `emitted` as the
    output so far, the prompt's logprobs asked again only if the client has not had them."""
    resumed = decode_pb2.DecodeRequest(keepalive_s=message.keepalive_s)
    resumed.request.CopyFrom(message.request)
    resumed.request.output_token_ids[:] = emitted
    if not keep_prompt_logprobs:
        resumed.request.params.ClearField("prompt_logprobs")
    return resumed
