"""A GGUF file's tensor table, read without decoding its metadata values.

gguf's `GGUFReader` turns every metadata value into numpy views, which for a
262,144-token vocabulary (Gemma 3) is a million small arrays and ~25 s. Serving
its projections needs only the tensors' names, shapes, types and bytes, so the
metadata is walked with `struct` (strings skipped by their lengths) and the
tensor data is a memory map of the file:

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:  key (u64 length + bytes), value type u32, value (arrays: type u32, count u64, items)
    tensors:   name, dims count u32, dims u64 (innermost first), type u32, offset u64 (from the data start)
    padding to `general.alignment` (32 by default), then the tensor data
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# metadata value types (gguf's GGUFValueType) of a fixed size, by their bytes
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: innermost (input) first
    type_name: str  # "Q4_K", "F32", ...
    data: np.ndarray  # its bytes, u8 (a view of the file's memory map)


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.buf.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return int(value)

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode()

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.pos += _FIXED[vtype]
        elif vtype == _STRING:
            n = self.take("Q")  # read before pos: `pos += take()` would add to the pos before the read
            self.pos += n
        elif vtype == _ARRAY:
            itype, count = self.take("I"), self.take("Q")
            if itype in _FIXED:
                self.pos += _FIXED[itype] * count
            else:
                for _ in range(count):
                    self.skip_value(itype)
        else:
            raise ValueError(f"unknown GGUF metadata type {vtype}")


def read_gguf_tensors(path: Path) -> tuple[dict[str, GGUFTensor], str]:
    """(the file's tensors by name, its general.architecture)."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path.name} is not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("I"), cur.take("Q"), cur.take("Q")
    if version < 2:
        raise ValueError(f"{path.name}: GGUF version {version} is not read here (2 or later)")
    arch, alignment = "", 32
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("I")
        if key == "general.architecture" and vtype == _STRING:
            arch = cur.string()
        elif key == "general.alignment" and vtype == 4:
            alignment = cur.take("I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        infos.append((name, dims, cur.take("I"), cur.take("Q")))
    start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        qtype = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * block_bytes
        tensors[name] = GGUFTensor(name, dims, qtype.name, buf[start + offset:start + offset + nbytes])
    return tensors, arch
