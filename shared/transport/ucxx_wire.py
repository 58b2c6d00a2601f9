"""The ucxx transport's messages: 64-bit tags and the control frames.

    tag = kind (2 bits) | transfer key (40 bits) | descriptor index (22 bits)
          CTRL  01        0                        0        control frames to an agent's server
          DATA  10        key                      i        the bytes of descriptor i
          REPLY 11        key                      0        the target's verdict on transfer `key`

The key is random per transfer, so tags from different initiators and
transfers do not collide at a target (which matches tags worker-wide).

    control frame = magic "BUX1" | op u8 | key u64 | name_nbytes u16 | name | body
        HELLO body: the initiator's worker address (the target replies through it)
        READ/WRITE body: num_descs u32 | num_descs x (addr u64, nbytes u64)  (target memory)
    reply frame = status u8 (0 ok) | error_nbytes u16 | error
"""

from __future__ import annotations

import enum
import secrets
import struct
from dataclasses import dataclass

from shared.transport.base import Descriptor, TransportError

CTRL_TAG = 0b01 << 62
_DATA_KIND = 0b10 << 62
_REPLY_KIND = 0b11 << 62
KEY_BITS = 40
INDEX_BITS = 22
MAX_DESCS = 1 << INDEX_BITS
MAX_CTRL_NBYTES = 64 + 255 * 4 + MAX_DESCS * 16
REPLY_NBYTES = 1024

_HEAD = struct.Struct("<4sBQH")
_COUNT = struct.Struct("<I")
_DESC = struct.Struct("<QQ")
_REPLY = struct.Struct("<BH")
_MAGIC = b"BUX1"


class CtrlOp(enum.IntEnum):
    HELLO = 1
    READ = 2
    WRITE = 3


@dataclass(frozen=True)
class Ctrl:
    op: CtrlOp
    key: int
    sender: str
    address: bytes = b""  # HELLO only
    descs: tuple[Descriptor, ...] = ()  # READ/WRITE only


def new_key() -> int:
    return secrets.randbits(KEY_BITS)


def data_tag(key: int, index: int) -> int:
    return _DATA_KIND | (key << INDEX_BITS) | index


def reply_tag(key: int) -> int:
    return _REPLY_KIND | (key << INDEX_BITS)


def encode_ctrl(ctrl: Ctrl) -> bytes:
    name = ctrl.sender.encode()
    head = _HEAD.pack(_MAGIC, ctrl.op, ctrl.key, len(name)) + name
    if ctrl.op is CtrlOp.HELLO:
        return head + ctrl.address
    return head + _COUNT.pack(len(ctrl.descs)) + b"".join(_DESC.pack(d.addr, d.nbytes) for d in ctrl.descs)


def decode_ctrl(frame: bytes) -> Ctrl:
    try:
        magic, op, key, name_nbytes = _HEAD.unpack_from(frame)
        if magic != _MAGIC:
            raise TransportError("not a ucxx transport control frame")
        pos = _HEAD.size + name_nbytes
        sender = frame[_HEAD.size:pos].decode()
        ctrl_op = CtrlOp(op)
        if ctrl_op is CtrlOp.HELLO:
            return Ctrl(ctrl_op, key, sender, address=bytes(frame[pos:]))
        (count,) = _COUNT.unpack_from(frame, pos)
        body = frame[pos + _COUNT.size:]
        if count > MAX_DESCS or len(body) != count * _DESC.size:
            raise TransportError(f"control frame with {count} descriptors and {len(body)} body bytes")
        descs = tuple(Descriptor(addr, nbytes) for addr, nbytes in _DESC.iter_unpack(body))
        return Ctrl(ctrl_op, key, sender, descs=descs)
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise TransportError(f"malformed control frame: {e}") from e


def encode_reply(error: str | None) -> bytes:
    message = (error or "").encode()[:REPLY_NBYTES - _REPLY.size]
    return _REPLY.pack(0 if error is None else 1, len(message)) + message


def decode_reply(frame: bytes | bytearray) -> str | None:
    """None when the target reports success, else its error."""
    status, nbytes = _REPLY.unpack_from(frame)
    if status == 0:
        return None
    error = bytes(frame[_REPLY.size:_REPLY.size + nbytes]).decode(errors="replace")
    return error or "target reported an error"
