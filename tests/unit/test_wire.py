"""shared.wire: protobuf <-> dataclass round trips for requests, sampling params and logprobs."""

from __future__ import annotations

import pytest

from proto.baton.v1 import common_pb2
from shared import wire
from shared.engine.request import SamplingParams, TokenLogprobs
from shared.errors import InvalidRequestError

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
