"""Conversions between baton.v1 protobuf messages and baton's plain dataclasses.

Services call these in `server.py` (and in their gRPC clients) only; inside a
service everything is a dataclass. Whatever comes off the wire is validated
here and fails with `InvalidRequestError`.

A handoff travels as a stream of `HandoffChunk`s, one per part of
`shared.handoff_stream` (header, one KVData per layer, HiddenData if any);
that module says what a whole stream is.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from proto.baton.v1 import common_pb2, kv_transfer_pb2
from shared.engine.handoff import KVHandoff
from shared.engine.request import SamplingParams, TokenLogprobs
from shared.errors import InvalidRequestError
from shared.handoff_stream import (
    HandoffAssembly,
    HandoffInfo,
    HandoffPart,
    HandoffPayload,
    HiddenStateData,
    KVLayerData,
    handoff_info,
    handoff_parts,
    payload_to_handoff,
)
from shared.kv.layout import KVLayout
from shared.registry.base import Load

if TYPE_CHECKING:  # the engine's load snapshot; importing the engine here would pull in the models
    from shared.engine.async_engine import EngineLoad

__all__ = [
    "HandoffInfo",
    "HandoffPayload",
    "HandoffStreamReader",
    "decode_handoff",
    "decode_handoff_stream",
    "dtype_from_name",
    "dtype_name",
    "encode_handoff",
    "header_from_proto",
    "header_to_proto",
    "load_from_proto",
    "load_report_to_proto",
    "part_from_chunk",
    "part_to_chunk",
    "payload_chunks",
    "sampling_params_from_proto",
    "sampling_params_to_proto",
    "token_logprobs_from_proto",
    "token_logprobs_to_proto",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
MAX_HANDOFF_ID_CHARS = 256
MAX_NUM_LAYERS = 4096  # bounds what a header can make a receiver allocate before any data


def dtype_name(dtype: torch.dtype) -> str:
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    raise InvalidRequestError(f"KV dtype {dtype} cannot be sent; use one of {sorted(DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidRequestError(f"unknown KV dtype {name!r}; expected one of {sorted(DTYPES)}") from None


# --- sampling params and logprobs -------------------------------------------------------------


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validated SamplingParams; proto3 zero defaults are taken literally (max_tokens=0 is invalid)."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def load_report_to_proto(load: EngineLoad) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        num_running=load.num_running, num_waiting=load.num_waiting,
        num_kv_blocks_total=load.num_kv_blocks_total, num_kv_blocks_free=load.num_kv_blocks_free,
    )


def load_from_proto(report: common_pb2.LoadReport) -> Load:
    return Load(report.num_running, report.num_waiting, report.num_kv_blocks_total, report.num_kv_blocks_free)


def token_logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        top=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def token_logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.token_id, logprob=msg.logprob, top=[(alt.token_id, alt.logprob) for alt in msg.top]
    )


# --- handoff: header and parts ----------------------------------------------------------------


def header_to_proto(info: HandoffInfo) -> kv_transfer_pb2.HandoffHeader:
    layout = info.layout
    msg = kv_transfer_pb2.HandoffHeader(
        handoff_id=info.handoff_id,
        request_id=info.request_id,
        prompt_token_ids=info.prompt_token_ids,
        first_token_id=info.first_token_id,
        layout=kv_transfer_pb2.KVLayoutDesc(
            model=info.model,
            num_layers=layout.num_layers,
            block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=dtype_name(layout.dtype),
        ),
        num_blocks=layout.num_blocks,
        hidden_size=info.hidden_size,
        num_hidden_tokens=info.num_hidden_tokens,
        lease_timeout_ms=info.lease_timeout_ms,
    )
    if info.first_logprobs is not None:
        msg.first_logprobs.CopyFrom(token_logprobs_to_proto(info.first_logprobs))
    return msg


def _check_header(msg: kv_transfer_pb2.HandoffHeader) -> None:
    if not msg.handoff_id or len(msg.handoff_id) > MAX_HANDOFF_ID_CHARS:
        raise InvalidRequestError(
            f"handoff_id must be 1..{MAX_HANDOFF_ID_CHARS} characters", param="handoff_id"
        )
    desc = msg.layout
    if desc.num_layers > MAX_NUM_LAYERS:
        raise InvalidRequestError(
            f"handoff {msg.handoff_id}: num_layers {desc.num_layers} > {MAX_NUM_LAYERS}", param="num_layers"
        )
    dims = {
        "num_layers": desc.num_layers,
        "block_size": desc.block_size,
        "num_kv_heads": desc.num_kv_heads,
        "head_dim": desc.head_dim,
        "num_blocks": msg.num_blocks,
    }
    for name, value in dims.items():
        if value < 1:
            raise InvalidRequestError(
                f"handoff {msg.handoff_id}: {name} must be >= 1, got {value}", param=name
            )
    if not msg.prompt_token_ids:
        raise InvalidRequestError(f"handoff {msg.handoff_id}: no prompt tokens", param="prompt_token_ids")
    if msg.num_hidden_tokens > 0 and msg.hidden_size < 1:
        raise InvalidRequestError(
            f"handoff {msg.handoff_id}: hidden states announced without hidden_size", param="hidden_size"
        )


def header_from_proto(msg: kv_transfer_pb2.HandoffHeader) -> HandoffInfo:
    """A validated HandoffInfo (ids present, every dimension positive, dtype known)."""
    _check_header(msg)
    desc = msg.layout
    layout = KVLayout(
        num_layers=desc.num_layers,
        num_blocks=msg.num_blocks,
        block_size=desc.block_size,
        num_kv_heads=desc.num_kv_heads,
        head_dim=desc.head_dim,
        dtype=dtype_from_name(desc.dtype),
    )
    first_logprobs = msg.first_logprobs if msg.HasField("first_logprobs") else None
    return HandoffInfo(
        handoff_id=msg.handoff_id,
        request_id=msg.request_id,
        model=desc.model,
        layout=layout,
        prompt_token_ids=list(msg.prompt_token_ids),
        first_token_id=msg.first_token_id,
        first_logprobs=token_logprobs_from_proto(first_logprobs) if first_logprobs is not None else None,
        hidden_size=msg.hidden_size,
        num_hidden_tokens=msg.num_hidden_tokens,
        lease_timeout_ms=msg.lease_timeout_ms,
    )


def part_to_chunk(part: HandoffPart) -> kv_transfer_pb2.HandoffChunk:
    if isinstance(part, HandoffInfo):
        return kv_transfer_pb2.HandoffChunk(header=header_to_proto(part))
    if isinstance(part, KVLayerData):
        return kv_transfer_pb2.HandoffChunk(kv=kv_transfer_pb2.KVData(layer=part.layer, data=part.data))
    return kv_transfer_pb2.HandoffChunk(hidden=kv_transfer_pb2.HiddenData(data=part.data))


def part_from_chunk(chunk: kv_transfer_pb2.HandoffChunk) -> HandoffPart:
    kind = chunk.WhichOneof("kind")
    if kind == "header":
        return header_from_proto(chunk.header)
    if kind == "kv":
        return KVLayerData(layer=chunk.kv.layer, data=chunk.kv.data)
    if kind == "hidden":
        return HiddenStateData(data=chunk.hidden.data)
    raise InvalidRequestError("empty HandoffChunk (no header, kv or hidden set)")


# --- handoff: whole streams -------------------------------------------------------------------


def payload_chunks(payload: HandoffPayload) -> Iterator[kv_transfer_pb2.HandoffChunk]:
    """The HandoffChunk stream of a stored payload (what Claim sends)."""
    return (part_to_chunk(part) for part in payload.parts())


class HandoffStreamReader:
    """Feeds a HandoffChunk stream (header first) into a HandoffAssembly."""

    def __init__(self) -> None:
        self.assembly: HandoffAssembly | None = None

    def feed(self, chunk: kv_transfer_pb2.HandoffChunk) -> HandoffPart:
        part = part_from_chunk(chunk)
        if isinstance(part, HandoffInfo):
            if self.assembly is not None:
                raise InvalidRequestError(f"handoff {part.handoff_id}: a second header in one stream")
            self.assembly = HandoffAssembly(part)
        elif self.assembly is None:
            raise InvalidRequestError("a handoff stream must start with its header")
        else:
            self.assembly.add(part)
        return part

    def finish(self) -> HandoffPayload:
        if self.assembly is None:
            raise InvalidRequestError("empty handoff stream")
        return self.assembly.finish()


def encode_handoff(
    handoff: KVHandoff, *, handoff_id: str, request_id: str, model: str, lease_timeout_ms: int = 0
) -> Iterator[kv_transfer_pb2.HandoffChunk]:
    """The HandoffChunk stream for a Put: header, one KVData per layer, HiddenData (if any)."""
    info = handoff_info(
        handoff, handoff_id=handoff_id, request_id=request_id, model=model, lease_timeout_ms=lease_timeout_ms
    )
    return (part_to_chunk(part) for part in handoff_parts(handoff, info))


def decode_handoff(chunks: Iterable[kv_transfer_pb2.HandoffChunk]) -> tuple[HandoffInfo, KVHandoff]:
    """Collect a HandoffChunk stream back into its header and a KVHandoff (sizes checked)."""
    reader = HandoffStreamReader()
    for chunk in chunks:
        reader.feed(chunk)
    payload = reader.finish()
    return payload.info, payload_to_handoff(payload)


async def decode_handoff_stream(
    chunks: AsyncIterable[kv_transfer_pb2.HandoffChunk],
) -> tuple[HandoffInfo, KVHandoff]:
    """`decode_handoff` for an async stream (e.g. a grpc.aio Claim call)."""
    reader = HandoffStreamReader()
    async for chunk in chunks:
        reader.feed(chunk)
    payload = reader.finish()
    return payload.info, payload_to_handoff(payload)
