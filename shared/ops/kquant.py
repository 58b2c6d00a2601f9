"""GGUF's K-quant super-blocks (Q4_K, Q6_K) as the file holds them, served by the quantized GEMV.

A super-block covers 256 inputs of an output; its sub-blocks share one fp16 scale:

    format  file bytes (256 weights)                          codes c    w[k]
    Q4_K    d, dmin (fp16); 12 bytes: 6-bit sc and mn of      0..15      d * sc[j] * c - dmin * mn[j]
            8 sub-blocks of 32; 128 bytes of nibbles                     (j = k // 32)
    Q6_K    128 bytes of low nibbles, 64 of high bit pairs,   0..63      d * sc[j] * (c - 32)
            16 int8 sc, d (fp16)                                         (j = k // 16)

The codes and scales are read out of the file's bytes once (no value changes)
and packed per panel of 16 outputs (`csrc/qgemv_layout.h`); `csrc/qgemv_cpu.cpp`
multiplies them by rows quantized to int8 per block of 32, in int32 per
sub-block (vpdpbusd with AVX512-VNNI). `shared/ops/quant.py` has the block
formats and `qgemv_ref`, the dequantize-then-matmul oracle of both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.ops.quant import GGUF_FORMATS, QuantCodes, concat_rows, from_gguf_blocks

SUPER = 256
K_FORMATS = {"Q4_K": (4, 144), "Q6_K": (6, 210)}  # bits of a code, bytes of a super-block


@dataclass(frozen=True)
class KQuantCodes:
    """A weight [N, K] in Q4_K or Q6_K (see the module docstring)."""

    codes: torch.Tensor  # [N, K] uint8
    d: torch.Tensor  # [N, K / 256] float16
    dmin: torch.Tensor  # [N, K / 256] float16 (Q6_K: zeros)
    scales: torch.Tensor  # Q4_K [N, K / 32] uint8; Q6_K [N, K / 16] int8
    mins: torch.Tensor  # Q4_K [N, K / 32] uint8; Q6_K [N, 0]
    fmt: str  # "Q4_K" or "Q6_K"

    @property
    def bits(self) -> int:
        return K_FORMATS[self.fmt][0]

    def rows(self, index: torch.Tensor) -> KQuantCodes:  # index [N'] int64: these rows, in this order
        return KQuantCodes(self.codes[index], self.d[index], self.dmin[index], self.scales[index],
                           self.mins[index], self.fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]; float32 as gguf does
        sub = self.codes.shape[1] // self.scales.shape[1]  # inputs per sub-block: 32 or 16
        per_sub = SUPER // sub
        d = self.d.to(dtype).repeat_interleave(per_sub, dim=1)  # [N, K / sub]
        scale = (d * self.scales.to(dtype)).repeat_interleave(sub, dim=1)
        if self.fmt == "Q6_K":
            return scale * (self.codes.to(dtype) - 32)
        offset = (self.dmin.to(dtype).repeat_interleave(per_sub, dim=1) * self.mins.to(dtype))
        return scale * self.codes.to(dtype) - offset.repeat_interleave(sub, dim=1)

    def pack(self) -> torch.Tensor:
        """The kernel's layout (csrc/qgemv_layout.h)."""
        return torch.ops.baton_cpu.qgemv_pack_k(  # type: ignore[no-any-return]
            self.codes, self.d, self.dmin, self.scales, self.mins, self.bits)


def _half(blocks: np.ndarray, at: int) -> torch.Tensor:  # the fp16 at byte `at` of each super-block
    return torch.from_numpy(np.ascontiguousarray(blocks[:, :, at:at + 2]).view(np.float16)[..., 0].copy())


def _q4_k(blocks: np.ndarray, n: int, k: int) -> KQuantCodes:
    # 12 bytes of scales as 3 rows of 4: a = low 6 bits of sc[0..3], b = of mn[0..3], c = nibbles of sc / mn
    # [4..7]; the top 2 bits of a and b are bits 4-5 of sc / mn [4..7]
    s = blocks[:, :, 4:16].reshape(n, -1, 3, 4)
    a, b, c = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=2).reshape(n, -1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=2).reshape(n, -1)
    # 4 chunks of 32 bytes: low nibbles are sub-block 2i, high nibbles 2i + 1
    qs = blocks[:, :, 16:144].reshape(n, -1, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
    return KQuantCodes(torch.from_numpy(np.ascontiguousarray(codes)), _half(blocks, 0), _half(blocks, 2),
                       torch.from_numpy(np.ascontiguousarray(sc)), torch.from_numpy(np.ascontiguousarray(mn)), "Q4_K")


def _q6_k(blocks: np.ndarray, n: int, k: int) -> KQuantCodes:
    # per half (128 weights): 64 bytes of nibbles (low: weights 0..63, high: 64..127) and 32 bytes of pairs
    # (bits 2i, 2i + 1 of byte l: weight 32i + l)
    ql = blocks[:, :, 0:128].reshape(n, -1, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(n, -1, 2, 128)
    qh = blocks[:, :, 128:192].reshape(n, -1, 2, 1, 32)
    high = np.concatenate([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=3).reshape(n, -1, 2, 128)
    codes = (low | (high << 4)).reshape(n, k)
    sc = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(n, -1)
    d = _half(blocks, 208)
    return KQuantCodes(torch.from_numpy(np.ascontiguousarray(codes)), d, torch.zeros_like(d),
                       torch.from_numpy(sc.copy()), torch.zeros(n, 0, dtype=torch.uint8), "Q6_K")


def gguf_codes(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantCodes | KQuantCodes:
    """Codes of a GGUF tensor's raw blocks (`raw`: its bytes) of shape [N, K], in any served format."""
    if type_name in GGUF_FORMATS:
        return from_gguf_blocks(type_name, raw, shape)
    if type_name not in K_FORMATS:
        raise ValueError(f"GGUF block type {type_name} is not served quantized here "
                         f"(only {sorted(GGUF_FORMATS) + sorted(K_FORMATS)})")
    n, k = shape
    if k % SUPER:
        raise ValueError(f"a [{n}, {k}] tensor is not whole super-blocks of {SUPER}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // SUPER, K_FORMATS[type_name][1])
    return _q4_k(blocks, n, k) if type_name == "Q4_K" else _q6_k(blocks, n, k)


def concat_codes(parts: list[QuantCodes | KQuantCodes]) -> QuantCodes | KQuantCodes:
    """Rows of several weights of one input width as one weight (q, k, v -> qkv): block formats of any code
    width together, or super-blocks of one format."""
    if all(isinstance(p, QuantCodes) for p in parts):
        return concat_rows([p for p in parts if isinstance(p, QuantCodes)])
    kparts = [p for p in parts if isinstance(p, KQuantCodes)]
    if len(kparts) != len(parts) or len({p.fmt for p in kparts}) != 1:
        raise ValueError(f"rows of {sorted({p.fmt for p in parts})} cannot share one weight: "
                         "their blocks differ in size")
    codes, d, dmin, scales, mins = (torch.cat([getattr(p, f) for p in kparts])
                                    for f in ("codes", "d", "dmin", "scales", "mins"))
    return KQuantCodes(codes, d, dmin, scales, mins, kparts[0].fmt)
