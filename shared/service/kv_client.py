"""Client side of kv_transfer's control path for the engine services: reserve, commit, claim, release; the
shared encoder-output cache.

Channels are kept per address for the life of the service (one HTTP/2
connection each, reused by every request). Every call carries the current trace
context, so kv_transfer's spans join the request's trace. The KV bytes never
pass through here: the engine's transport agent moves them (`shared.engine.kv_link`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import grpc
import torch

from proto.baton.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from shared.errors import BatonError, KVTransferError, UnavailableError
from shared.grpc_common import channel
from shared.grpc_errors import error_from_rpc
from shared.kv.remote import AgentAddress, ClaimedHandoff, HandoffResult, HandoffSlots, HandoffSpec
from shared.telemetry import inject_metadata
from shared.wire_encoder import encoder_output_from_proto, encoder_output_to_proto
from shared.wire_kv import claimed_from_proto, commit_to_proto, reserve_to_proto, slots_from_proto

logger = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 10.0

T = TypeVar("T")


class KVTransferClient:
    def __init__(self, max_message_bytes: int) -> None:
        self._max_message_bytes = max_message_bytes
        self._stubs: dict[str, kv_transfer_pb2_grpc.KVTransferServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._cleanups: set[asyncio.Future[None]] = set()

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            ch = channel(address, self._max_message_bytes)
            self._channels.append(ch)
            stub = self._stubs[address] = kv_transfer_pb2_grpc.KVTransferServiceStub(ch)
        return stub

    async def reserve(self, address: str, spec: HandoffSpec) -> tuple[HandoffSlots, AgentAddress]:
        """Pin slots for the handoff; blocks the prefix pool holds come back present."""
        try:
            # wait_for_ready: a kv_transfer restarting (or a channel backing off) is waited for, up to the timeout
            reply = await self._stub(address).Reserve(reserve_to_proto(spec), timeout=_CONTROL_TIMEOUT_S,
                                                      metadata=inject_metadata(), wait_for_ready=True)
        except grpc.RpcError as e:
            raise _kv_error(e, address) from e
        return slots_from_proto(reply, spec)

    async def renew(self, address: str, handoff_id: str, capability: str = "") -> bool:
        """Keep a handoff being written alive; False when it already ended.

        `capability` (here and below): the handoff's secret, as the router gave it; kv_transfer checks it.
        """
        try:
            request = kv_transfer_pb2.RenewRequest(handoff_id=handoff_id, capability=capability)
            reply = await self._stub(address).Renew(request,
                                                    timeout=_CONTROL_TIMEOUT_S, metadata=inject_metadata())
        except grpc.RpcError as e:
            logger.warning("renewing handoff %s failed: %s", handoff_id, error_from_rpc(e))
            return False
        return bool(reply.found)

    async def commit(self, address: str, handoff_id: str, result: HandoffResult, capability: str = "") -> int:
        """Make a fully written handoff claimable; returns the bytes of slots it holds."""
        try:
            reply = await self._stub(address).Commit(commit_to_proto(handoff_id, result, capability),
                                                     timeout=_CONTROL_TIMEOUT_S, metadata=inject_metadata())
        except grpc.RpcError as e:
            raise _kv_error(e, address) from e
        return int(reply.nbytes)

    async def claim(self, address: str, handoff_id: str, *, wait_s: float, timeout_s: float, capability: str = ""
                    ) -> tuple[ClaimedHandoff, AgentAddress]:
        """Take the handoff: where its blocks are. Release it once pulled (or on failure)."""
        request = kv_transfer_pb2.ClaimRequest(handoff_id=handoff_id, wait_ms=int(wait_s * 1000),
                                               capability=capability)
        try:
            reply = await self._stub(address).Claim(request, timeout=timeout_s, metadata=inject_metadata(),
                                                    wait_for_ready=True)
        except grpc.RpcError as e:
            raise _kv_error(e, address) from e
        return claimed_from_proto(reply, handoff_id)

    async def release(self, address: str, handoff_id: str, failed: bool = False, capability: str = "",
                      transfers_stopped: bool = False) -> bool:
        """End the handoff (best effort: a lease nobody releases expires on its own). `transfers_stopped`: the
        caller is the peer writing or reading it, and its transfers on it are over (a handoff being written or
        read keeps its slots until then)."""
        try:
            request = kv_transfer_pb2.ReleaseRequest(handoff_id=handoff_id, failed=failed, capability=capability,
                                                     transfers_stopped=transfers_stopped)
            reply = await self._stub(address).Release(request, timeout=5, metadata=inject_metadata())
        except grpc.RpcError as e:
            logger.warning("release of handoff %s failed: %s", handoff_id, error_from_rpc(e))
            return False
        return bool(reply.found)

    async def release_after_abort(
        self, abort: Callable[[], Awaitable[object]], address: str, handoff_id: str, failed: bool = False,
        capability: str = "",
    ) -> None:
        """`abort` the request in the engine (its transfers stop), then release the handoff, so no transfer of
        ours touches a slot given to someone else. Runs to the end even if the caller is cancelled; `close`
        waits for it."""

        async def cleanup() -> None:
            try:
                await abort()
            except UnavailableError:
                pass  # engine stopped: its transports are closed, nothing moves any more
            # the engine's transfers have stopped: the handoff's slots may go to someone else now
            await self.release(address, handoff_id, failed=failed, capability=capability, transfers_stopped=True)

        task = asyncio.ensure_future(cleanup())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def get_encoder_outputs(self, address: str, model: str,
                                  content_hashes: Sequence[bytes]) -> dict[bytes, torch.Tensor]:
        """The encoder outputs kv_transfer holds for these media digests ([num_soft_tokens, hidden] each, on
        the CPU). A failed call finds nothing (the caller encodes): a cache must never fail a request."""
        outputs = await self._ask_encoder_outputs(address, model, content_hashes, digests_only=False)
        try:
            return dict(encoder_output_from_proto(msg) for msg in outputs)
        except BatonError as e:
            logger.warning("kv_transfer at %s sent a malformed encoder output: %s", address, e)
            return {}

    async def held_encoder_outputs(self, address: str, model: str, content_hashes: Sequence[bytes]) -> set[bytes]:
        """Which of these digests kv_transfer holds outputs for (none when the call failed)."""
        outputs = await self._ask_encoder_outputs(address, model, content_hashes, digests_only=True)
        return {bytes(msg.content_hash) for msg in outputs}

    async def _ask_encoder_outputs(self, address: str, model: str, content_hashes: Sequence[bytes],
                                   digests_only: bool) -> Sequence[kv_transfer_pb2.EncoderOutput]:
        try:
            reply = await self._stub(address).GetEncoderOutputs(
                kv_transfer_pb2.GetEncoderOutputsRequest(model=model, content_hashes=list(content_hashes),
                                                         digests_only=digests_only),
                timeout=_CONTROL_TIMEOUT_S, metadata=inject_metadata())
        except grpc.RpcError as e:
            logger.warning("asking kv_transfer at %s for encoder outputs failed: %s", address, error_from_rpc(e))
            return []
        return reply.outputs  # type: ignore[no-any-return]

    async def put_encoder_outputs(self, address: str, model: str, outputs: Mapping[bytes, torch.Tensor]) -> int:
        """Offer encoder outputs to kv_transfer's cache; returns how many it kept (0 when the call failed)."""
        try:
            reply = await self._stub(address).PutEncoderOutputs(
                kv_transfer_pb2.PutEncoderOutputsRequest(
                    model=model, outputs=[encoder_output_to_proto(h, t) for h, t in outputs.items()]),
                timeout=_CONTROL_TIMEOUT_S, metadata=inject_metadata())
            return int(reply.num_stored)
        except (grpc.RpcError, BatonError) as e:
            logger.warning("offering encoder outputs to kv_transfer at %s failed: %s", address,
                           error_from_rpc(e) if isinstance(e, grpc.RpcError) else e)
            return 0

    def in_background(self, call: Awaitable[T]) -> asyncio.Future[T]:
        """Run a call of this client without waiting for it; `close` waits for it."""
        task = asyncio.ensure_future(call)
        self._cleanups.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._cleanups.discard)  # type: ignore[arg-type]
        return task

    async def close(self) -> None:
        if self._cleanups:  # releases in flight: let them reach kv_transfer (leases would expire anyway)
            await asyncio.wait(self._cleanups, timeout=_CONTROL_TIMEOUT_S)
        for ch in self._channels:
            await ch.close()


def _kv_error(e: grpc.RpcError, address: str) -> BatonError:
    """The error of a failed kv_transfer call. A deadline passed waiting for the service (wait_for_ready) is
    the service being unreachable, not the request aborted: UNAVAILABLE, so callers retry or fall back."""
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
        return KVTransferError(f"kv_transfer at {address} did not answer in time")
    return error_from_rpc(e)
