"""The router's encode step (encode -> prefill -> decode): a request's media encoded on an encoder instance.

The encoder puts the outputs in the kv_transfer the request's prefill will use, which then finds them
there instead of running its own towers. Only bad media is the request's error (a 400, as the prefill
would have answered); any other failure costs the encoder's time, and the prefill encodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from proto.baton.v1 import encoder_pb2, encoder_pb2_grpc
from services.router.backend import BackendRequest
from services.router.routing import Router
from shared.errors import UnavailableError
from shared.grpc_errors import error_from_rpc
from shared.registry.base import InstanceInfo
from shared.wire import media_to_proto

logger = logging.getLogger(__name__)


async def encode_media(router: Router, encoders: Sequence[InstanceInfo], channel: Callable[[str], grpc.aio.Channel],
                       req: BackendRequest, kv_transfer_address: str | None,
                       metadata: Sequence[tuple[str, str]]) -> None:
    """Encode `req`'s media on the least loaded of `encoders` into `kv_transfer_address`'s cache."""
    if kv_transfer_address is None:
        return
    try:
        instance = router.pick_encoder(encoders)
    except UnavailableError:  # every encoder draining
        return
    message = encoder_pb2.EncodeRequest(request_id=req.request_id, media=media_to_proto(req.media),
                                        kv_transfer_address=kv_transfer_address)
    try:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel(instance.address))
        with router.hold("encoder", instance.instance_id):
            await stub.Encode(message, metadata=metadata)
    except grpc.RpcError as e:
        error = error_from_rpc(e)
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # type: ignore[attr-defined]
            raise error from e
        logger.warning("request %s: encoder %s failed (%s); the prefill encodes", req.request_id,
                       instance.address, error)
