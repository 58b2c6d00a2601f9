"""kv_transfer's encoder-output cache (an LRU bounded by bytes) and the checks on its wire messages."""

from __future__ import annotations

import pytest
import torch

from proto.baton.v1 import kv_transfer_pb2
from services.kv_transfer.encoder_cache import EncoderOutputCache, EncoderOutputEntry
from shared.errors import InvalidRequestError
from shared.wire_encoder import encoder_output_from_proto, encoder_output_to_proto


def _entry(name: bytes, nbytes: int) -> EncoderOutputEntry:
    return EncoderOutputEntry(name, "float32", (nbytes // 16, 4), bytes(nbytes))


def test_least_recently_used_outputs_go_first_and_bytes_are_counted() -> None:
    cache = EncoderOutputCache(capacity_bytes=300)
    assert cache.put("m", [_entry(b"a", 96), _entry(b"b", 96), _entry(b"c", 96)]) == 3
    assert cache.nbytes == 288
    assert [e.content_hash for e in cache.get("m", [b"a"])] == [b"a"]  # a is now the newest
    cache.put("m", [_entry(b"d", 96)])
    assert [e.content_hash for e in cache.get("m", [b"a", b"b", b"c", b"d"])] == [b"a", b"c", b"d"]
    assert (cache.num_hits, cache.num_misses, cache.num_evicted, cache.nbytes) == (4, 1, 1, 288)


def test_models_are_kept_apart_and_a_replaced_output_is_counted_once() -> None:
    cache = EncoderOutputCache(capacity_bytes=1000)
    cache.put("m1", [_entry(b"a", 96)])
    assert cache.get("m2", [b"a"]) == []
    cache.put("m1", [_entry(b"a", 160)])
    assert len(cache) == 1 and cache.nbytes == 160


def test_an_output_larger_than_the_cache_is_not_kept() -> None:
    cache = EncoderOutputCache(capacity_bytes=100)
    cache.put("m", [_entry(b"a", 96)])
    assert cache.put("m", [_entry(b"big", 160)]) == 0
    assert [e.content_hash for e in cache.get("m", [b"a", b"big"])] == [b"a"]
    assert EncoderOutputCache(0).put("m", [_entry(b"a", 16)]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_outputs_cross_the_wire_bit_identical(dtype: torch.dtype) -> None:
    out = torch.randn(7, 24).to(dtype)
    digest, back = encoder_output_from_proto(encoder_output_to_proto(b"\x01" * 32, out))
    assert digest == b"\x01" * 32 and back.dtype == dtype and torch.equal(back, out)


@pytest.mark.parametrize("change, match", [
    (dict(dtype="int8"), "unknown dtype"),
    (dict(shape=[7]), r"\[num_soft_tokens, hidden\]"),
    (dict(shape=[7, 0]), r"\[num_soft_tokens, hidden\]"),
    (dict(data=b"\x00" * 10), "bytes"),
    (dict(content_hash=b""), "content_hash"),
    (dict(content_hash=b"x" * 65), "content_hash"),
])
def test_a_malformed_output_is_refused(change: dict, match: str) -> None:
    msg = encoder_output_to_proto(b"\x01" * 32, torch.zeros(7, 24))
    fields = dict(content_hash=msg.content_hash, dtype=msg.dtype, shape=list(msg.shape), data=msg.data) | change
    with pytest.raises(InvalidRequestError, match=match):
        encoder_output_from_proto(kv_transfer_pb2.EncoderOutput(**fields))
