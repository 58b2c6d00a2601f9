"""shared.wire: protobuf <-> dataclass round trips, and every way a handoff stream can be wrong."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from proto.baton.v1 import common_pb2, kv_transfer_pb2
from shared import wire
from shared.engine.handoff import KVHandoff
from shared.engine.request import SamplingParams, TokenLogprobs
from shared.errors import InvalidRequestError


def make_handoff(
    dtype: torch.dtype = torch.float32, num_hidden_tokens: int = 5, logprobs: bool = True
) -> KVHandoff:
    gen = torch.Generator().manual_seed(0)
    # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
    kv = torch.randn((3, 2, 2, 4, 2, 8), generator=gen).to(dtype)
    hidden = torch.randn((num_hidden_tokens, 16), generator=gen).to(dtype)  # [num_tokens, hidden]
    return KVHandoff(
        prompt_token_ids=[5, 6, 7, 8, 9],
        first_token_id=42,
        first_logprobs=TokenLogprobs(42, -0.25, [(42, -0.25), (7, -2.5)]) if logprobs else None,
        block_size=4,
        kv=kv,
        hidden_states=hidden,
    )


def chunks_of(handoff: KVHandoff, **overrides: object) -> list[kv_transfer_pb2.HandoffChunk]:
    args: dict[str, object] = {"handoff_id": "h1", "request_id": "r1", "model": "tiny", "lease_timeout_ms": 0}
    args.update(overrides)
    return list(wire.encode_handoff(handoff, **args))  # type: ignore[arg-type]


# --- sampling params and logprobs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(max_tokens=7, temperature=0.0, top_k=1, stop_token_ids=(2, 3), ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.5, top_p=0.75, seed=0, min_tokens=4, logprobs=0),
        SamplingParams(seed=2**63, logprobs=20),
    ],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    msg = common_pb2.SamplingParams.FromString(wire.sampling_params_to_proto(params).SerializeToString())
    assert wire.sampling_params_from_proto(msg) == params


def test_unset_optionals_stay_unset() -> None:
    msg = wire.sampling_params_to_proto(SamplingParams())
    assert not msg.HasField("seed") and not msg.HasField("logprobs")
    back = wire.sampling_params_from_proto(msg)
    assert back.seed is None and back.logprobs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0, "top_p": 1.0}, "max_tokens"),  # proto3 default: max_tokens unset
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_p": 1.0, "temperature": -1.0}, "temperature"),
        ({"max_tokens": 4, "top_p": 1.0, "temperature": float("nan")}, "temperature"),
        ({"max_tokens": 4, "top_p": 1.0, "min_tokens": 5}, "min_tokens"),
        ({"max_tokens": 4, "top_p": 1.0, "logprobs": 21}, "logprobs"),
    ],
)
def test_invalid_sampling_params_are_invalid_requests(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        wire.sampling_params_from_proto(common_pb2.SamplingParams(**fields))  # type: ignore[arg-type]
    assert info.value.param == param


def test_token_logprobs_round_trip() -> None:
    logprobs = TokenLogprobs(3, -0.5, [(3, -0.5), (11, -1.25), (0, -8.0)])
    msg = common_pb2.TokenLogprobs.FromString(wire.token_logprobs_to_proto(logprobs).SerializeToString())
    assert wire.token_logprobs_from_proto(msg) == logprobs


# --- handoff ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_handoff_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    handoff = make_handoff(dtype)
    chunks = chunks_of(handoff, lease_timeout_ms=1500)
    kinds = [chunk.WhichOneof("kind") for chunk in chunks]
    assert kinds == ["header", "kv", "kv", "kv", "hidden"]
    wire_chunks = [kv_transfer_pb2.HandoffChunk.FromString(c.SerializeToString()) for c in chunks]

    info, back = wire.decode_handoff(wire_chunks)
    assert (info.handoff_id, info.request_id, info.model, info.lease_timeout_ms) == ("h1", "r1", "tiny", 1500)
    assert info.layout.dtype == dtype and info.layout.num_blocks == 2 and info.hidden_size == 16
    assert back.kv.dtype == dtype and back.kv.shape == handoff.kv.shape
    assert torch.equal(back.kv.view(torch.uint8), handoff.kv.view(torch.uint8))
    assert torch.equal(back.hidden_states.view(torch.uint8), handoff.hidden_states.view(torch.uint8))
    assert back.prompt_token_ids == handoff.prompt_token_ids
    assert back.first_token_id == 42 and back.block_size == 4
    assert back.first_logprobs == handoff.first_logprobs


def test_handoff_without_hidden_states_or_logprobs() -> None:
    handoff = make_handoff(num_hidden_tokens=0, logprobs=False)
    chunks = chunks_of(handoff)
    assert [c.WhichOneof("kind") for c in chunks] == ["header", "kv", "kv", "kv"]
    info, back = wire.decode_handoff(chunks)
    assert info.num_hidden_tokens == 0 and back.hidden_states.shape == (0, 16)
    assert back.first_logprobs is None
    assert torch.equal(back.kv, handoff.kv)


def test_hidden_states_travel_in_the_layout_dtype() -> None:
    handoff = make_handoff(torch.bfloat16)
    handoff.hidden_states = handoff.hidden_states.float()
    _, back = wire.decode_handoff(chunks_of(handoff))
    assert back.hidden_states.dtype == torch.bfloat16
    assert torch.equal(back.hidden_states, handoff.hidden_states.to(torch.bfloat16))


def test_decode_handoff_stream_accepts_async_iterables() -> None:
    handoff = make_handoff()

    async def stream() -> AsyncIterator[kv_transfer_pb2.HandoffChunk]:
        for chunk in chunks_of(handoff):
            yield chunk

    _, back = asyncio.run(wire.decode_handoff_stream(stream()))
    assert torch.equal(back.kv, handoff.kv)


def test_layers_may_arrive_in_any_order() -> None:
    chunks = chunks_of(make_handoff())
    reordered = [chunks[0], chunks[3], chunks[1], chunks[2], chunks[4]]
    _, back = wire.decode_handoff(reordered)
    assert torch.equal(back.kv, make_handoff().kv)


def _bad_stream(case: str) -> list[kv_transfer_pb2.HandoffChunk]:
    header, kv0, kv1, kv2, hidden = chunks_of(make_handoff())
    short = kv_transfer_pb2.HandoffChunk(kv=kv_transfer_pb2.KVData(layer=1, data=kv1.kv.data[:-1]))
    layer9 = kv_transfer_pb2.HandoffChunk(kv=kv_transfer_pb2.KVData(layer=9, data=kv1.kv.data))
    return {
        "no header": [kv0, kv1, kv2, hidden],
        "two headers": [header, header, kv0, kv1, kv2, hidden],
        "short layer": [header, kv0, short, kv2, hidden],
        "layer out of range": [header, kv0, layer9],
        "layer twice": [header, kv0, kv0, kv2, hidden],
        "missing layer": [header, kv0, kv2, hidden],
        "missing hidden": [header, kv0, kv1, kv2],
        "data after hidden": [header, kv0, kv1, hidden, kv2],
        "empty chunk": [header, kv_transfer_pb2.HandoffChunk()],
        "empty stream": [],
    }[case]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no header", "start with its header"),
        ("two headers", "second header"),
        ("short layer", "header implies"),
        ("layer out of range", "outside"),
        ("layer twice", "twice"),
        ("missing layer", r"missing layers \[1\]"),
        ("missing hidden", "hidden states missing"),
        ("data after hidden", "after the hidden"),
        ("empty chunk", "empty HandoffChunk"),
        ("empty stream", "empty handoff stream"),
    ],
)
def test_malformed_streams_are_invalid_requests(case: str, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        wire.decode_handoff(_bad_stream(case))


def test_hidden_states_not_announced_are_refused() -> None:
    header, kv0, kv1, kv2 = chunks_of(make_handoff(num_hidden_tokens=0))
    hidden = kv_transfer_pb2.HandoffChunk(hidden=kv_transfer_pb2.HiddenData(data=b"\x00" * 8))
    with pytest.raises(InvalidRequestError, match="not announced"):
        wire.decode_handoff([header, kv0, kv1, kv2, hidden])


@pytest.mark.parametrize(
    ("mutate", "param"),
    [
        (lambda h: setattr(h, "handoff_id", ""), "handoff_id"),
        (lambda h: setattr(h, "handoff_id", "x" * 300), "handoff_id"),
        (lambda h: setattr(h.layout, "num_layers", 0), "num_layers"),
        (lambda h: setattr(h.layout, "num_layers", 10**6), "num_layers"),
        (lambda h: setattr(h.layout, "head_dim", 0), "head_dim"),
        (lambda h: setattr(h, "num_blocks", 0), "num_blocks"),
        (lambda h: h.ClearField("prompt_token_ids"), "prompt_token_ids"),
        (lambda h: setattr(h, "hidden_size", 0), "hidden_size"),
        (lambda h: setattr(h.layout, "dtype", "int8"), None),
    ],
    ids=[
        "no-id",
        "long-id",
        "no-layers",
        "too-many-layers",
        "no-head-dim",
        "no-blocks",
        "no-prompt",
        "no-hidden-size",
        "bad-dtype",
    ],
)
def test_bad_headers_are_invalid_requests(mutate: object, param: str | None) -> None:
    header = chunks_of(make_handoff())[0].header
    mutate(header)  # type: ignore[operator]
    with pytest.raises(InvalidRequestError) as info:
        wire.header_from_proto(header)
    assert info.value.param == param


def test_header_round_trip_and_sizes() -> None:
    handoff = make_handoff(torch.float16)
    info = wire.header_from_proto(chunks_of(handoff)[0].header)
    assert wire.header_from_proto(wire.header_to_proto(info)) == info
    assert info.layer_nbytes == handoff.kv[0].numel() * 2
    assert info.hidden_nbytes == handoff.hidden_states.numel() * 2
    assert info.total_nbytes == handoff.nbytes


def test_unsupported_dtype_cannot_be_sent() -> None:
    handoff = make_handoff()
    handoff.kv = handoff.kv.double()
    with pytest.raises(InvalidRequestError, match="cannot be sent"):
        chunks_of(handoff)
