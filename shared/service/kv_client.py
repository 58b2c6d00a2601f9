"""Client side of kv_transfer for the engine services: push a handoff, claim one.

Channels are kept per address for the life of the service (one HTTP/2
connection each, reused by every request). Every call carries the current trace
context, so kv_transfer's spans join the request's trace.
"""

from __future__ import annotations

import logging

import grpc

from proto.baton.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from shared.engine.handoff import KVHandoff
from shared.grpc_common import channel
from shared.grpc_errors import error_from_rpc
from shared.handoff_stream import HandoffInfo
from shared.telemetry import inject_metadata
from shared.wire import decode_handoff_stream, encode_handoff

logger = logging.getLogger(__name__)


class KVTransferClient:
    def __init__(self, max_message_bytes: int) -> None:
        self._max_message_bytes = max_message_bytes
        self._stubs: dict[str, kv_transfer_pb2_grpc.KVTransferServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            ch = channel(address, self._max_message_bytes)
            self._channels.append(ch)
            stub = self._stubs[address] = kv_transfer_pb2_grpc.KVTransferServiceStub(ch)
        return stub

    async def put(
        self, address: str, handoff: KVHandoff, *, handoff_id: str, request_id: str, model: str,
        timeout_s: float,
    ) -> int:
        """Store the handoff under `handoff_id`; returns the bytes kv_transfer holds."""
        chunks = encode_handoff(handoff, handoff_id=handoff_id, request_id=request_id, model=model)
        try:
            reply = await self._stub(address).Put(chunks, timeout=timeout_s, metadata=inject_metadata())
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        logger.debug("request %s: handoff %s stored (%d bytes)", request_id, handoff_id, reply.nbytes)
        return int(reply.nbytes)

    async def claim(self, address: str, handoff_id: str, *, wait_s: float, timeout_s: float
                    ) -> tuple[HandoffInfo, KVHandoff]:
        """Take the handoff (its lease ends when the stream completes)."""
        request = kv_transfer_pb2.ClaimRequest(handoff_id=handoff_id, wait_ms=int(wait_s * 1000))
        try:
            call = self._stub(address).Claim(request, timeout=timeout_s, metadata=inject_metadata())
            return await decode_handoff_stream(call)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e

    async def release(self, address: str, handoff_id: str) -> None:
        try:
            request = kv_transfer_pb2.ReleaseRequest(handoff_id=handoff_id)
            await self._stub(address).Release(request, timeout=5, metadata=inject_metadata())
        except grpc.RpcError as e:
            logger.warning("release of handoff %s failed: %s", handoff_id, error_from_rpc(e))

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
