"""The seam between the HTTP layer and whatever produces tokens.

    router (HTTP) ── BackendRequest ──► GenerationBackend.generate() ──► BackendChunk ... (finished=True)
                 ── abort(request_id) ─►  (client gone, stop string matched, error)

A backend streams token ids only; text, stop strings and the OpenAI shapes are the
router's business. `EngineBackend` (engine_backend.py) runs a colocated engine in
this process; the disaggregated path implements the same protocol over gRPC to
prefill and decode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from shared.engine.request import SamplingParams, TokenLogprobs
from shared.multimodal.items import MediaItem


@dataclass(frozen=True)
class BackendRequest:
    """One generation request, already tokenized and validated by the router."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    media: tuple[MediaItem, ...] = ()  # images and audio at their placeholder tokens


@dataclass
class BackendChunk:
    """New tokens since the previous chunk. The last chunk of a request has finished=True."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token when params.logprobs is set
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (0 when unknown)
    index: int = 0  # which choice these tokens belong to (params.n > 1); each choice finishes on its own
    # params.prompt_logprobs: one entry per prompt token (the first None: nothing scores it), on the
    # first chunk of choice 0 only
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@runtime_checkable
class GenerationBackend(Protocol):
    """What the router needs from a token producer.

    `generate` is an async generator (implement it as `async def generate(...)` with
    `yield`): it streams chunks until one has finished=True, and raises `BatonError`
    subclasses (CapacityError -> 429, UnavailableError -> 503, InvalidRequestError -> 400)
    when the request cannot be served. Closing the iterator early does not by itself stop
    the work; the router calls `abort`, which is idempotent and ignores unknown or
    finished ids.
    """

    def generate(self, req: BackendRequest) -> AsyncIterator[BackendChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    def healthy(self) -> bool: ...

    def instance_counts(self) -> dict[str, int]:
        """Live instances per service this backend routes to (empty: it routes to none, an in-process
        engine); /health reports them, and `baton up` waits until every instance it started is seen."""
        ...
