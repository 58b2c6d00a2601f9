"""How the router's gRPC backend reads a decode stream's message into a chunk (grpc_backend._chunk)."""

from __future__ import annotations

from proto.baton.v1 import common_pb2, decode_pb2
from services.router.backend import BackendRequest
from services.router.grpc_backend import _chunk
from shared.engine.request import SamplingParams


def test_a_pulled_requests_cached_tokens_are_the_prefills_not_the_decodes() -> None:
    """usage.cached_tokens counts prompt tokens not computed. After a handoff the decode instance's own cache
    hit only saved pulling those blocks: the prefill's count (the first chunk's) stands."""
    req = BackendRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, prompt_logprobs=1))
    msg = decode_pb2.DecodeResponse(token_ids=[7], num_cached_tokens=32,
                                    prompt_logprobs=[common_pb2.TokenLogprobs(token_id=2, logprob=-1.0)])
    pulled = _chunk(msg, req, computed_prompt=False)
    assert pulled.num_cached_tokens == 0 and pulled.prompt_logprobs is None and pulled.token_ids == [7]
    computed = _chunk(msg, req, computed_prompt=True)  # colocated, a local prefill, a migrated request
    assert computed.num_cached_tokens == 32 and computed.prompt_logprobs is not None
