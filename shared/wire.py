"""Conversions between baton.v1 protobuf messages and baton's plain dataclasses.

Services call these in `server.py` (and in their gRPC clients) only; inside a
service everything is a dataclass. Whatever comes off the wire is validated
here and fails with `InvalidRequestError`.

kv_transfer's messages (the KV handoff's control path) are in `shared.wire_kv`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from proto.baton.v1 import common_pb2
from shared.engine.choices import FirstToken
from shared.engine.request import SamplingParams, TokenLogprobs
from shared.errors import InvalidRequestError
from shared.multimodal.items import AUDIO, IMAGE, VIDEO, MediaItem
from shared.multimodal.media import content_hash
from shared.registry.base import Load
from shared.registry.kv_summary import MAX_SUMMARY_BLOCKS, KVSummary
from shared.structured.spec import GrammarSpec, ReasoningSpec

if TYPE_CHECKING:  # the engine's load snapshot; importing the engine here would pull in the models
    from shared.engine.async_engine import EngineLoad

__all__ = [
    "dtype_from_name",
    "dtype_name",
    "first_token_from_proto",
    "first_token_to_proto",
    "load_from_proto",
    "load_report_to_proto",
    "sampling_params_from_proto",
    "sampling_params_to_proto",
    "token_logprobs_from_proto",
    "token_logprobs_to_proto",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,  # an fp8 KV cache's blocks
    "float8_e5m2": torch.float8_e5m2,
}


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
    _logits_processing_to_proto(params, msg)
    return msg


def _logits_processing_to_proto(params: SamplingParams, msg: common_pb2.SamplingParams) -> None:
    msg.n = params.n
    msg.presence_penalty = params.presence_penalty
    msg.frequency_penalty = params.frequency_penalty
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    msg.logit_bias.extend(common_pb2.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias)
    msg.min_p = params.min_p
    if params.structured is not None:
        g = params.structured
        msg.structured.CopyFrom(common_pb2.GrammarSpec(kind=g.kind, source=g.source, any_whitespace=g.any_whitespace))
    if params.reasoning is not None:
        r = params.reasoning
        msg.reasoning.CopyFrom(common_pb2.ReasoningSpec(
            start_token_ids=list(r.start_token_ids), end_token_ids=list(r.end_token_ids),
            thinking_at_start=r.thinking_at_start, budget=r.budget,
        ))
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.stream_interval is not None:
        msg.stream_interval = params.stream_interval


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
        n=msg.n,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias),
        min_p=msg.min_p,
        structured=_grammar_from_proto(msg.structured) if msg.HasField("structured") else None,
        reasoning=_reasoning_from_proto(msg.reasoning) if msg.HasField("reasoning") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        stream_interval=msg.stream_interval if msg.HasField("stream_interval") else None,
    )


def _grammar_from_proto(msg: common_pb2.GrammarSpec) -> GrammarSpec:
    return GrammarSpec(kind=msg.kind, source=msg.source, any_whitespace=msg.any_whitespace)


def _reasoning_from_proto(msg: common_pb2.ReasoningSpec) -> ReasoningSpec:
    return ReasoningSpec(
        start_token_ids=tuple(msg.start_token_ids), end_token_ids=tuple(msg.end_token_ids),
        thinking_at_start=msg.thinking_at_start, budget=msg.budget if msg.HasField("budget") else None,
    )


def load_report_to_proto(load: EngineLoad, kv: KVSummary | None = None) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        num_running=load.num_running, num_waiting=load.num_waiting,
        num_kv_blocks_total=load.num_kv_blocks_total, num_kv_blocks_free=load.num_kv_blocks_free,
        kv=kv_summary_to_proto(kv) if kv is not None else None,
    )


def load_from_proto(report: common_pb2.LoadReport) -> Load:
    return Load(report.num_running, report.num_waiting, report.num_kv_blocks_total, report.num_kv_blocks_free)


def kv_summary_to_proto(kv: KVSummary) -> common_pb2.KVSummary:
    return common_pb2.KVSummary(block_size=kv.block_size, hash_salt=kv.hash_salt,
                                block_hashes=[bytes.fromhex(h) for h in kv.block_hashes])


def kv_summary_from_proto(msg: common_pb2.KVSummary) -> KVSummary:
    return KVSummary(block_size=msg.block_size, hash_salt=msg.hash_salt,
                     block_hashes=tuple(h.hex() for h in msg.block_hashes[:MAX_SUMMARY_BLOCKS]))


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


def first_token_to_proto(token_id: int, logprobs: TokenLogprobs | None) -> common_pb2.FirstToken:
    msg = common_pb2.FirstToken(token_id=token_id)
    if logprobs is not None:
        msg.logprobs.CopyFrom(token_logprobs_to_proto(logprobs))
    return msg


def first_token_from_proto(msg: common_pb2.FirstToken) -> FirstToken:
    return FirstToken(msg.token_id, token_logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None)


def media_to_proto(items: Sequence[MediaItem]) -> list[common_pb2.MediaItem]:
    return [common_pb2.MediaItem(kind=m.kind, offset=m.offset, num_tokens=m.num_tokens, content_hash=m.content_hash,
                                 data=m.data, audio_format=m.audio_format) for m in items]


def media_from_proto(msgs: Sequence[common_pb2.MediaItem]) -> list[MediaItem]:
    """A request's media; the engine checks them against the prompt's placeholders."""
    items = []
    for m in msgs:
        if m.kind not in (IMAGE, AUDIO, VIDEO):
            raise InvalidRequestError(f"media kind {m.kind!r} is not image, audio or video", param="media")
        if m.content_hash != content_hash(m.data):  # the prefix cache trusts the digest: it must name the data
            raise InvalidRequestError("a media item's content_hash does not match its data", param="media")
        items.append(MediaItem(m.kind, m.offset, m.num_tokens, m.content_hash, m.data, m.audio_format))
    return items
