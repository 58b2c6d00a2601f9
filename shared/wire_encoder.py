"""Encoder outputs on the wire (kv_transfer's PutEncoderOutputs / GetEncoderOutputs): tensor <-> protobuf.

An output is [num_soft_tokens, hidden] in the encoder's dtype, sent as its raw
row-major bytes with dtype and shape; every message is checked (a known dtype,
two dimensions, bytes that match them) before anyone builds a tensor from it.
"""

from __future__ import annotations

import math

import torch

from proto.baton.v1 import kv_transfer_pb2
from shared.errors import InvalidRequestError
from shared.wire import DTYPES, dtype_from_name, dtype_name

MAX_DIGEST_BYTES = 64


def encoder_outputs_key(model_identity: str, dtype: torch.dtype) -> str:
    """Whose outputs these are in kv_transfer's cache: the model (LoadedModel.identity) and the towers' dtype.
    A prefill and an encoder service of the same model must name them alike, or the cache never hits."""
    return f"{model_identity}:{dtype_name(dtype)}"


def encoder_output_to_proto(content_hash: bytes, output: torch.Tensor) -> kv_transfer_pb2.EncoderOutput:
    """`output`: [num_soft_tokens, hidden], any device."""
    t = output.detach().to("cpu").contiguous()
    return kv_transfer_pb2.EncoderOutput(content_hash=content_hash, dtype=dtype_name(t.dtype), shape=list(t.shape),
                                         data=t.view(torch.uint8).numpy().tobytes())


def check_encoder_output(msg: kv_transfer_pb2.EncoderOutput) -> None:
    """Raises InvalidRequestError unless the message describes a tensor its bytes hold."""
    if not msg.content_hash or len(msg.content_hash) > MAX_DIGEST_BYTES:
        raise InvalidRequestError(f"an encoder output needs a content_hash of 1 to {MAX_DIGEST_BYTES} bytes",
                                  param="content_hash")
    if msg.dtype not in DTYPES:
        raise InvalidRequestError(f"unknown dtype {msg.dtype!r}; expected one of {sorted(DTYPES)}", param="dtype")
    if len(msg.shape) != 2 or min(msg.shape) == 0:
        raise InvalidRequestError(f"an encoder output is [num_soft_tokens, hidden], not {list(msg.shape)}",
                                  param="shape")
    want = math.prod(msg.shape) * DTYPES[msg.dtype].itemsize
    if len(msg.data) != want:
        raise InvalidRequestError(f"{list(msg.shape)} {msg.dtype} is {want} bytes, the message holds "
                                  f"{len(msg.data)}", param="data")


def encoder_output_from_proto(msg: kv_transfer_pb2.EncoderOutput) -> tuple[bytes, torch.Tensor]:
    """(the media digest, its [num_soft_tokens, hidden] output on the CPU)."""
    check_encoder_output(msg)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return bytes(msg.content_hash), flat.view(dtype_from_name(msg.dtype)).view(*msg.shape)
