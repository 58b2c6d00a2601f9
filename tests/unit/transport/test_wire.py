"""The bytes on the side: metadata envelopes and the ucxx backend's tags and frames."""

from __future__ import annotations

import pytest

from shared.transport import Descriptor, MemoryRegion, MemType, TransportError
from shared.transport.metadata import AgentMetadata
from shared.transport.ucxx_wire import (
    CTRL_TAG,
    INDEX_BITS,
    KEY_BITS,
    MAX_DESCS,
    REPLY_NBYTES,
    Ctrl,
    CtrlOp,
    data_tag,
    decode_ctrl,
    decode_reply,
    encode_ctrl,
    encode_reply,
    new_key,
    reply_tag,
)


def test_metadata_round_trips() -> None:
    regions = (MemoryRegion(4096, 1 << 20), MemoryRegion(1 << 40, 64, MemType.VRAM, 3))
    md = AgentMetadata("nixl", "prefill-0", regions, b"\x00opaque\xffblob")
    assert AgentMetadata.decode(md.encode()) == md


@pytest.mark.parametrize("data", [
    b"", b"garbage", b"BATONMD1\xff\xff\xff\x7f{}", b"BATONMD1\x02\x00\x00\x00{}",
    b"BATONMD1\x0b\x00\x00\x00{\"kind\": 1}",
])
def test_metadata_rejects_garbage(data: bytes) -> None:
    with pytest.raises(TransportError):
        AgentMetadata.decode(data)


def test_tags_do_not_collide() -> None:
    key = (1 << KEY_BITS) - 1
    data_tags = {data_tag(key, i) for i in (0, 1, MAX_DESCS - 1)} | {data_tag(0, 0)}
    tags = {CTRL_TAG, reply_tag(key), reply_tag(0), *data_tags}
    assert len(tags) == 7
    assert all(0 <= t < 1 << 64 for t in tags)
    assert data_tag(1, 0) >> INDEX_BITS != data_tag(2, 0) >> INDEX_BITS
    assert 0 <= new_key() < 1 << KEY_BITS


def test_control_frames_round_trip() -> None:
    hello = Ctrl(CtrlOp.HELLO, 0, "decode-1", address=b"\x01\x02worker")
    read = Ctrl(CtrlOp.READ, 12345, "decode-1", descs=(Descriptor(1 << 30, 4096), Descriptor(7, 1)))
    for ctrl in (hello, read, Ctrl(CtrlOp.WRITE, 1, "p", descs=())):
        assert decode_ctrl(encode_ctrl(ctrl)) == ctrl


TOO_MANY_DESCS = encode_ctrl(Ctrl(CtrlOp.READ, 1, "a"))[:-1] + b"\x01"  # count = 1 << 24


@pytest.mark.parametrize("frame", [b"", b"XXXX" + bytes(20), TOO_MANY_DESCS])
def test_control_frames_reject_garbage(frame: bytes) -> None:
    with pytest.raises(TransportError):
        decode_ctrl(frame)


def test_replies() -> None:
    assert decode_reply(bytearray(encode_reply(None)) + bytearray(10)) is None
    assert decode_reply(encode_reply("range not registered")) == "range not registered"
    assert len(encode_reply("x" * 10_000)) <= REPLY_NBYTES
