"""The router's backend over gRPC: prefill -> kv_transfer -> decode, or one colocated engine.

Disaggregated request lifecycle (the picks are routing.py's, under the configured policy)::

    local prefill on? pick decode; what its prefix cache lacks <= threshold ──► decode.Generate(request)
        │ (no handoff: the decode instance computes the prompt, the colocated path)
        ▼ otherwise
    pick kv_transfer (prompt-prefix affinity, for its prefix pool)
    images or audio, and encoder instances live? Encode(items, kv_transfer) on the least loaded one: their
        outputs wait in kv_transfer for the prefill (an encoder that fails is skipped: prefill encodes)
    pick prefill (cost model / queue)
    Prefill(request, handoff_id, capability) ──fails before the first token──► retry on another prefill
        │                                     (all failed, or no kv_transfer: a decode computes the prompt)
        │ first token (streams to the client now: TTFT is prefill's time)
        │ finish_reason set (max_tokens=1, eos) ──► done, no decode
        ▼
    pick decode now (draining ones skipped) ──refused before reaching it──► another decode
    decode.Generate(request, handoff_id, first_token) ──► token batches ──► finished
        └─ breaks mid-stream (dies, goes silent) ──► migration.py: another decode resumes from the tokens sent
    abort(request_id): Abort on the prefill and decode it used, Release its handoff.

Every Prefill call and every Generate stream is counted in `Router.inflight` while it is open, so
picks made between load reports see what this router already sent.

Instances come from the registry through instance_cache.py. Every call made for a request carries the trace context that
was current when `generate` started (the router's request span), so the services'
spans join the request's trace whichever task sends the call (aborts included).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from proto.baton.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.router.backend import BackendChunk, BackendRequest
from services.router.encode_step import encode_media
from services.router.instance_cache import InstanceCache
from services.router.migration import (
    MIGRATABLE_CODES,
    DecodeStalledError,
    MigrationPolicy,
    keepalive_s,
    ping_interval_s,
    read_stream,
    resumed_message,
)
from services.router.routing import Router
from shared.engine.choices import split_choice_id
from shared.errors import BatonError, InvalidRequestError, UnavailableError
from shared.grpc_auth import token_metadata
from shared.grpc_common import channel
from shared.grpc_errors import error_from_rpc
from shared.registry.base import InstanceInfo
from shared.registry.kv_picker import PromptBlocks
from shared.registry.kv_summary import KVSummary
from shared.registry.picker import pick_kv_transfer
from shared.telemetry import inject_metadata
from shared.wire import media_to_proto, sampling_params_to_proto, token_logprobs_from_proto

logger = logging.getLogger(__name__)

_MAX_REFUSALS = 4  # decode calls refused before reaching an instance, retried as they were
_WAIT_POLL_S = 0.25  # how often a request waiting for a live instance looks at the registry cache again
# a prefill failing with one of these before its first token is retried elsewhere (a full
# kv_transfer store, RESOURCE_EXHAUSTED, is not the prefill's fault: it goes back as 429)
_RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.DEADLINE_EXCEEDED}


class _PrefillFailedError(Exception):
    """Every prefill attempt failed on an instance fault (not the request's): `error` says how."""

    def __init__(self, error: BatonError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _InFlight:
    """Where one request's work lives, so that abort reaches all of it."""

    prefill: str | None = None
    decode: str | None = None
    kv_transfer: str | None = None
    handoff_id: str | None = None
    handoff_capability: str = ""  # the handoff's secret: kv_transfer wants it on every call about the handoff
    done: bool = False
    # every call's metadata: the request's W3C trace context and the internal token (the channels add none)
    metadata: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _DecodeLeg:
    """One request's decode stream across the instances it tries (migration.py)."""

    message: decode_pb2.DecodeRequest  # what the next attempt sends
    service: str  # "decode", or "colocated" in colocated mode
    emitted: list[int] = field(default_factory=list)  # tokens the client has (n == 1), for a migration
    tried: set[tuple[str, float]] = field(default_factory=set)  # (instance id, start): a restart is a new one
    num_migrations: int = 0

    def tried_ids(self, live: list[InstanceInfo]) -> set[str]:
        """The ids of live instances this leg has already failed on (not their restarts)."""
        return {i.instance_id for i in live if (i.instance_id, i.started_at) in self.tried}


class GrpcBackend:
    """GenerationBackend over the registry's prefill/decode/kv_transfer instances."""

    def __init__(self, cache: InstanceCache, mode: str = "disagg", prefill_attempts: int = 2,
                 max_message_bytes: int = 64 << 20, router: Router | None = None,
                 migration: MigrationPolicy | None = None) -> None:
        if mode not in ("disagg", "colocated"):
            raise InvalidRequestError(f"mode must be disagg or colocated, got {mode!r}")
        self.cache = cache
        self.mode = mode
        self.prefill_attempts = prefill_attempts
        self.max_message_bytes = max_message_bytes
        self.router = router or Router()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._inflight: dict[str, _InFlight] = {}
        self.migration = migration or MigrationPolicy()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            # no interceptor on the token streams: each call carries the token in state.metadata
            ch = self._channels[address] = channel(address, self.max_message_bytes, token_interceptor=False,
                                                   keepalive_s=ping_interval_s(self.migration.stall_timeout_s))
        return ch

    def instance_counts(self) -> dict[str, int]:
        return self.cache.counts()

    def healthy(self) -> bool:
        if self.mode == "colocated":
            return bool(self.cache.get("colocated"))
        return all(self.cache.get(s) for s in ("prefill", "decode", "kv_transfer"))

    async def generate(self, req: BackendRequest) -> AsyncIterator[BackendChunk]:
        state = self._inflight[req.request_id] = _InFlight(metadata=[*inject_metadata(), *token_metadata()])
        prompt = PromptBlocks(req.prompt_token_ids)
        try:
            local = self._local_prefill_decode(prompt)
            if self.mode == "colocated" or local is not None:
                async for chunk in self._decode(req, state, None, prompt, first_choice=local):
                    yield chunk
                return
            first = await self._prefill_or_fall_back(req, state, prompt)
            if first is None:  # no prefill path works: a decode instance computes the prompt
                async for chunk in self._decode(req, state, None, prompt):
                    yield chunk
                return
            state.done = bool(first.finish_reason)  # nothing left to abort once it finished
            yield BackendChunk(
                token_ids=[first.first_token_id],
                logprobs=[token_logprobs_from_proto(first.first_logprobs)] if first.HasField("first_logprobs")
                else [],
                finished=bool(first.finish_reason), finish_reason=first.finish_reason or None,
                num_cached_tokens=first.num_cached_tokens,
                prompt_logprobs=[None, *(token_logprobs_from_proto(lp) for lp in first.prompt_logprobs)]
                if req.params.prompt_logprobs is not None else None,
            )
            for index, more in enumerate(first.more_choices, start=1):  # n > 1: decode tells how each ends
                yield BackendChunk(token_ids=[more.token_id], index=index, num_cached_tokens=first.num_cached_tokens,
                                   logprobs=[token_logprobs_from_proto(more.logprobs)] if more.HasField("logprobs")
                                   else [])
            if not first.finish_reason:
                async for chunk in self._decode(req, state, first, prompt):
                    yield chunk
        finally:
            if not state.done:
                await self.abort(req.request_id)
            self._inflight.pop(req.request_id, None)

    def _local_prefill_decode(self, prompt: PromptBlocks) -> InstanceInfo | None:
        """Disaggregated mode: the decode instance to compute this prompt itself, when local prefill is on
        and what that instance's prefix cache lacks is under the threshold; None to go through prefill."""
        if self.mode != "disagg" or not self.router.local_prefill_enabled:
            return None
        decode = self.router.pick_decode(self.cache.get("decode"), prompt, pulls=False)
        if not self.router.prefills_locally(decode, prompt):
            return None
        self.router.num_local_prefills += 1
        return decode

    async def _prefill_or_fall_back(self, req: BackendRequest, state: _InFlight,
                                    prompt: PromptBlocks) -> prefill_pb2.PrefillResponse | None:
        """Prefill's first token, or None when the prefill path failed before any token (its instances,
        or the kv_transfer it writes to, died or none is live) and migration is on: a decode computes it."""
        try:
            kv_transfer = pick_kv_transfer(self.cache.get("kv_transfer"), req.prompt_token_ids)
            state.kv_transfer = kv_transfer.address
            if req.media and self.cache.get("encoder"):
                await encode_media(self.router, self.cache.get("encoder"), self._channel, req, state.kv_transfer,
                                   state.metadata)
            return await self._prefill(req, state, prompt, kv_transfer.kv)
        except (UnavailableError, _PrefillFailedError) as e:
            error = e.error if isinstance(e, _PrefillFailedError) else e
            if self.migration.limit == 0 or not self.cache.get("decode"):
                raise error from None
            logger.warning("request %s: prefill path failed (%s); a decode instance computes the prompt",
                           req.request_id, error)
            self.router.num_migrations += 1
            await self._release(state)
            state.prefill = None
            return None

    async def _prefill(self, req: BackendRequest, state: _InFlight, prompt: PromptBlocks,
                       pool: KVSummary) -> prefill_pb2.PrefillResponse:
        """Prefill's first token; _PrefillFailedError when every attempt failed on an instance fault."""
        tried: set[str] = set()
        message = prefill_pb2.PrefillRequest(request=_request(req), kv_transfer_address=state.kv_transfer)
        last_error: BatonError | None = None
        while True:
            try:
                instance = self.router.pick_prefill(self.cache.get("prefill"), prompt, pool, exclude=tried)
            except UnavailableError:
                if last_error is not None:  # nowhere left to retry: the real failure, not "none left"
                    raise _PrefillFailedError(last_error) from None
                raise
            state.prefill = instance.address
            # a fresh handoff id per attempt (a released id is refused for good by kv_transfer), with a random
            # part so that no one can release one before it exists, and a secret without which kv_transfer
            # refuses every call about it
            state.handoff_id = message.handoff_id = f"handoff-{req.request_id}-{len(tried)}-{secrets.token_hex(4)}"
            state.handoff_capability = message.handoff_capability = secrets.token_urlsafe(24)
            self.router.sent(instance, prompt)
            try:
                stub = prefill_pb2_grpc.PrefillServiceStub(self._channel(instance.address))
                with self.router.hold("prefill", instance.instance_id):
                    return await stub.Prefill(message, metadata=state.metadata)
            except grpc.RpcError as e:
                code = e.code()  # type: ignore[attr-defined]
                tried.add(instance.instance_id)
                last_error = error_from_rpc(e)
                if code not in _RETRIABLE:
                    raise last_error from e
                if len(tried) >= self.prefill_attempts:
                    raise _PrefillFailedError(last_error) from e
                logger.warning("request %s: prefill on %s failed (%s), retrying elsewhere",
                               req.request_id, instance.address, code.name)
                await self._release(state)

    async def _decode(self, req: BackendRequest, state: _InFlight, first_token: prefill_pb2.PrefillResponse | None,
                      prompt: PromptBlocks, first_choice: InstanceInfo | None = None) -> AsyncIterator[BackendChunk]:
        """Stream from a decode instance, picked now (after prefill) so draining ones are skipped, or
        `first_choice` on the first attempt. Without `first_token` the instance computes the prompt.

        A call refused before it reached an instance (UNAVAILABLE with nothing received) is retried on
        another one: the handoff is still unclaimed in kv_transfer. A stream that breaks later migrates
        (migration.py): another instance goes on from the tokens the client has.
        """
        leg = _DecodeLeg(decode_pb2.DecodeRequest(request=_request(req),
                                                  keepalive_s=keepalive_s(self.migration.stall_timeout_s)),
                         "colocated" if self.mode == "colocated" else "decode")
        if first_token is not None:
            leg.message.handoff_id = state.handoff_id or ""
            leg.message.kv_transfer_address = state.kv_transfer or ""
            leg.message.handoff_capability = state.handoff_capability
            leg.message.first_token_id = first_token.first_token_id
            if first_token.HasField("first_logprobs"):
                leg.message.first_logprobs.CopyFrom(first_token.first_logprobs)
            leg.message.more_choices.extend(first_token.more_choices)
            leg.emitted.append(first_token.first_token_id)
        while True:
            live = self.cache.get(leg.service)
            instance = first_choice if first_choice is not None and not leg.tried else \
                self.router.pick_decode(live, prompt, leg.tried_ids(live), pulls=bool(leg.message.handoff_id))
            state.decode = instance.address
            self.router.sent(instance, prompt)
            received = False
            num_open = req.params.n  # choices not finished yet: each ends with its own finished message
            try:
                stub = decode_pb2_grpc.DecodeServiceStub(self._channel(instance.address))
                with self.router.hold("decode", instance.instance_id):
                    call = stub.Generate(leg.message, metadata=state.metadata)
                    async for msg in read_stream(call, self.migration.stall_timeout_s,
                                                   keepalive=leg.message.keepalive_s > 0):
                        received = True
                        num_open -= msg.finished
                        if num_open == 0:
                            state.done = True
                        leg.emitted.extend(msg.token_ids)
                        yield _chunk(msg, req, computed_prompt=not leg.message.handoff_id)
                return
            except (grpc.RpcError, DecodeStalledError) as e:
                if state.done:  # every choice had finished: what broke was the stream's end
                    return
                if not _handoff_lost(e):  # else the instance is well: it may take the request without one
                    leg.tried.add((instance.instance_id, instance.started_at))
                await self._recover(req, state, leg, e, received)

    async def _recover(self, req: BackendRequest, state: _InFlight, leg: _DecodeLeg,
                       e: grpc.RpcError | DecodeStalledError, received: bool) -> None:
        """After the leg's instance failed: set the leg up for its next attempt, or raise the failure."""
        error = e if isinstance(e, BatonError) else error_from_rpc(e)
        code = grpc.StatusCode.UNAVAILABLE if isinstance(e, BatonError) else e.code()  # type: ignore[attr-defined]
        # refused before reaching the instance (or its transport lost before any message): the same message goes
        # elsewhere, and if the instance had claimed the handoff the next one finds it gone (NOT_FOUND) and the
        # request migrates. A stall migrates at once: a silent instance most likely holds the handoff
        stalled = isinstance(e, DecodeStalledError)
        refused = code == grpc.StatusCode.UNAVAILABLE and not received and not stalled \
            and len(leg.tried) <= _MAX_REFUSALS
        if not (refused or self._may_migrate(req, code, leg.num_migrations)) \
                or not await self._wait_for_other(leg.service, leg.tried):
            raise error from e
        if refused:
            logger.warning("request %s: decode %s failed before its first token (%s), retrying elsewhere",
                           req.request_id, state.decode, error)
            return
        leg.num_migrations += 1
        self.router.num_migrations += 1
        logger.warning("request %s: decode %s failed after %d tokens (%s: %s); migrating (%d of %d)",
                       req.request_id, state.decode, len(leg.emitted), code.name, error, leg.num_migrations,
                       self.migration.limit)
        await self._leave(state, req.request_id, stalled=stalled)
        leg.message = resumed_message(leg.message, leg.emitted, keep_prompt_logprobs=not leg.emitted)

    def _may_migrate(self, req: BackendRequest, code: grpc.StatusCode, num_migrations: int) -> bool:
        """Whether a broken decode stream goes on elsewhere (n > 1 does not: its choices' tokens interleave)."""
        if code not in MIGRATABLE_CODES or req.params.n != 1:
            return False
        if num_migrations >= self.migration.limit:
            self.router.num_migrations_refused += 1
            return False
        return True

    async def _wait_for_other(self, service: str, tried: set[tuple[str, float]]) -> bool:
        """Whether an instance not yet tried is live, waiting up to the policy's wait_s for one (a supervisor
        restarting the only decode brings it back under a new instance id)."""
        deadline = asyncio.get_running_loop().time() + self.migration.wait_s
        while not any((i.instance_id, i.started_at) not in tried for i in self.cache.get(service)):
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(_WAIT_POLL_S)
        return True

    async def _leave(self, state: _InFlight, request_id: str, stalled: bool) -> None:
        """Leave a failed decode behind: release the handoff (unclaimed, or claimed by the dead one) and, if
        the instance only went silent, abort the request there. Awaited before the next pick: a restarted
        instance may take the old one's address, and the abort must not reach the request's new home."""
        await self._abort_on(request_id, state, None, state.decode if stalled else None)

    async def abort(self, request_id: str) -> None:
        """Abort a request everywhere, or one choice of an n > 1 request by its choice id (on its decode)."""
        state = self._inflight.get(request_id)
        choice = split_choice_id(request_id) if state is None else None
        if choice is not None:
            await self._abort_choice(request_id, self._inflight.get(choice[0]))
            return
        if state is None or state.done:
            return
        state.done = True
        await self._abort_on(request_id, state, state.prefill, state.decode)

    async def _abort_on(self, request_id: str, state: _InFlight, prefill: str | None, decode: str | None) -> None:
        """Abort on the instances given and release the request's handoff (once: the id is taken)."""
        req = common_pb2.AbortRequest(request_id=request_id)
        calls = []
        if prefill:
            calls.append(prefill_pb2_grpc.PrefillServiceStub(self._channel(prefill)).Abort(
                req, timeout=5, metadata=state.metadata))
        if decode:
            calls.append(decode_pb2_grpc.DecodeServiceStub(self._channel(decode)).Abort(
                req, timeout=5, metadata=state.metadata))
        results = await asyncio.gather(*calls, self._release(state), return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                logger.info("request %s: abort call failed: %s", request_id, r)

    async def _abort_choice(self, choice_id: str, state: _InFlight | None) -> None:
        if state is None or state.done or not state.decode:
            return  # not decoding yet: the caller drops the choice's tokens until it is
        try:
            await decode_pb2_grpc.DecodeServiceStub(self._channel(state.decode)).Abort(
                common_pb2.AbortRequest(request_id=choice_id), timeout=5, metadata=state.metadata)
        except grpc.RpcError as e:
            logger.info("abort of choice %s failed: %s", choice_id, e.code())  # type: ignore[attr-defined]

    async def _release(self, state: _InFlight) -> None:
        """Release the request's current handoff, once: the id is taken from `state` first."""
        handoff_id, state.handoff_id = state.handoff_id, None
        if state.kv_transfer and handoff_id:
            stub = kv_transfer_pb2_grpc.KVTransferServiceStub(self._channel(state.kv_transfer))
            try:
                await stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id=handoff_id,
                                                                  capability=state.handoff_capability),
                                   timeout=5, metadata=state.metadata)
            except grpc.RpcError as e:
                logger.info("release of %s failed: %s", handoff_id, e.code())  # type: ignore[attr-defined]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


def _handoff_lost(e: grpc.RpcError | DecodeStalledError) -> bool:
    """The call failed because its handoff is gone (claimed by an instance that went silent, or its
    kv_transfer restarted), not because of the instance that answered."""
    return isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def _chunk(msg: decode_pb2.DecodeResponse, req: BackendRequest, computed_prompt: bool) -> BackendChunk:
    """`computed_prompt`: the decode instance computed the prompt (colocated, a local prefill, a migrated
    request), so its prompt scores come with the stream and its prefix-cache hit is the request's. After a
    handoff the prefill's hit is (the first chunk's): what the decode found in its own cache only saved
    pulling those blocks, not computing them, and usage's cached_tokens counts prompt tokens not computed."""
    return BackendChunk(
        token_ids=list(msg.token_ids), logprobs=[token_logprobs_from_proto(lp) for lp in msg.logprobs],
        finished=msg.finished, finish_reason=msg.finish_reason or None,
        num_cached_tokens=msg.num_cached_tokens if computed_prompt else 0, index=msg.index,
        prompt_logprobs=[None, *(token_logprobs_from_proto(lp) for lp in msg.prompt_logprobs)]
        if computed_prompt and req.params.prompt_logprobs is not None and msg.prompt_logprobs else None,
    )


def _request(req: BackendRequest) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                      params=sampling_params_to_proto(req.params), media=media_to_proto(req.media))
