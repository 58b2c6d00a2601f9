"""shared.wire: protobuf <-> dataclass round trips for requests, sampling params and logprobs."""

from __future__ import annotations

import pytest

from proto.baton.v1 import common_pb2
from shared import wire
from shared.engine.request import SamplingParams, TokenLogprobs
from shared.errors import InvalidRequestError
from shared.structured.spec import GrammarSpec, ReasoningSpec

# --- sampling params and logprobs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(max_tokens=7, temperature=0.0, top_k=1, stop_token_ids=(2, 3), ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.5, top_p=0.75, seed=0, min_tokens=4, logprobs=0),
        SamplingParams(seed=2**63, logprobs=20),
        SamplingParams(n=3, presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.5,
                       logit_bias=((7, -100.0), (9, 2.5)), min_p=0.25, prompt_logprobs=2),
        SamplingParams(structured=GrammarSpec("json_schema", '{"type": "object"}', any_whitespace=True),
                       reasoning=ReasoningSpec((5,), (6, 7), thinking_at_start=True, budget=0)),
        SamplingParams(structured=GrammarSpec("json_object"), reasoning=ReasoningSpec((5,), (6,))),
        SamplingParams(stream_interval=8),
    ],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    msg = common_pb2.SamplingParams.FromString(wire.sampling_params_to_proto(params).SerializeToString())
    assert wire.sampling_params_from_proto(msg) == params


def test_unset_optionals_stay_unset() -> None:
    msg = wire.sampling_params_to_proto(SamplingParams())
    assert not msg.HasField("seed") and not msg.HasField("logprobs")
    assert not msg.HasField("structured") and not msg.HasField("reasoning") and not msg.HasField("prompt_logprobs")
    assert not msg.HasField("stream_interval")
    back = wire.sampling_params_from_proto(msg)
    assert back.seed is None and back.logprobs is None and back.stream_interval is None
    assert back.structured is None and back.reasoning is None and back.repetition_penalty == 1.0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0, "top_p": 1.0}, "max_tokens"),  # proto3 default: max_tokens unset
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_p": 1.0, "temperature": -1.0}, "temperature"),
        ({"max_tokens": 4, "top_p": 1.0, "temperature": float("nan")}, "temperature"),
        ({"max_tokens": 4, "top_p": 1.0, "min_tokens": 5}, "min_tokens"),
        ({"max_tokens": 4, "top_p": 1.0, "logprobs": 21}, "logprobs"),
        ({"max_tokens": 4, "top_p": 1.0}, "n"),  # proto3 default: n unset
        ({"max_tokens": 4, "top_p": 1.0, "n": 1, "presence_penalty": 2.5}, "presence_penalty"),
        ({"max_tokens": 4, "top_p": 1.0, "n": 1, "repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 4, "top_p": 1.0, "n": 1, "logit_bias": [common_pb2.LogitBias(token_id=1, bias=101)]},
         "logit_bias"),
        ({"max_tokens": 4, "top_p": 1.0, "n": 1, "min_p": 1.5}, "min_p"),
        ({"max_tokens": 4, "top_p": 1.0, "n": 1, "structured": common_pb2.GrammarSpec(kind="yaml", source="x")},
         "structured_outputs"),
        ({"max_tokens": 4, "top_p": 1.0, "n": 1, "structured": common_pb2.GrammarSpec(kind="regex")},
         "structured_outputs"),
        ({"max_tokens": 4, "top_p": 1.0, "n": 1, "stream_interval": 0}, "stream_interval"),
        ({"max_tokens": 4, "top_p": 1.0, "n": 1, "stream_interval": 1025}, "stream_interval"),
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


def test_negative_seed_is_its_twos_complement_everywhere() -> None:
    """OpenAI's seed is an int64, the wire's a uint64: -1 must not overflow the field (a 500 once) and must
    name one stream, colocated (the engine's own params) or through the wire."""
    params = SamplingParams(seed=-1)
    assert params.seed == 2**64 - 1 == SamplingParams(seed=2**64 - 1).seed
    msg = common_pb2.SamplingParams.FromString(wire.sampling_params_to_proto(params).SerializeToString())
    assert wire.sampling_params_from_proto(msg) == params
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=(3, -1))  # found by tests/e2e/test_api_fuzz.py: a 500 once
    assert info.value.param == "stop_token_ids"
    for seed in (-(2**63) - 1, 2**64):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(seed=seed)
        assert info.value.param == "seed"
