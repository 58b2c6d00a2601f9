"""Weights served in a quantized block format: GGUF's Q4_0, Q4_1, Q5_0, Q8_0 as the file holds them, or int8
per channel or 4-bit blocks (Q4_1's form) made from fp32 weights (GGUF's K-quant super-blocks:
`shared/ops/kquant.py`).

Every format becomes u8 codes with a fp16 scale d and offset m per block of 32
inputs of an output, w = d * c + m, without changing a code (`csrc/qgemv_layout.h`):

    format   file block (32 weights)          codes c       d          m
    Q4_0     d, 16 bytes of nibbles q         q (0..15)     d          -8 d
    Q4_1     d, m, 16 bytes of nibbles q      q (0..15)     d          m
    Q5_0     d, 4 bytes of bit 4, 16 of nibbles q (0..31)   d          -16 d
    Q8_0     d, 32 int8 q                     q + 128       d          -128 d
    int8     (per output row: d = max|w| / 127, q = round(w / d))  as Q8_0, one d per row
    q4_1     (per block: m = min w, d = (max w - m) / 15)             Q4_1's form, made from fp32 weights

`csrc/qgemv_cpu.cpp` multiplies them by rows quantized to int8 per block (as
llama.cpp does), with AVX512-VNNI where the CPU has it. `qgemv_ref` is its oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

BLOCK = 32
# GGUF block types served as they are, and the bits of their codes
GGUF_FORMATS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q8_0": 8}


@dataclass(frozen=True)
class QuantCodes:
    """A weight [N, K] as codes and per-block scales: w[n, k] = d[n, k // 32] * codes[n, k] + m[n, k // 32]."""

    codes: torch.Tensor  # [N, K] uint8
    d: torch.Tensor  # [N, K / 32] float16
    m: torch.Tensor  # [N, K / 32] float16
    bits: int  # 4, 5 or 8: the largest code fits in this many bits
    fmt: str  # where they came from: "Q4_0", "Q4_1", "Q8_0", "int8"

    def rows(self, index: torch.Tensor) -> QuantCodes:  # index [N'] int64: these rows, in this order
        return QuantCodes(self.codes[index], self.d[index], self.m[index], self.bits, self.fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]; float32 as ggml does
        scale = self.d.to(dtype).repeat_interleave(BLOCK, dim=1)
        offset = self.m.to(dtype).repeat_interleave(BLOCK, dim=1)
        return scale * self.codes.to(dtype) + offset

    def pack(self) -> torch.Tensor:
        """The kernel's layout (csrc/qgemv_layout.h)."""
        return torch.ops.baton_cpu.qgemv_pack(self.codes, self.d, self.m, self.bits)  # type: ignore[no-any-return]


def concat_rows(parts: list[QuantCodes]) -> QuantCodes:
    """Rows of several weights of one input width as one weight (q, k, v -> qkv); bits widen to the widest."""
    fmts = {p.fmt for p in parts}
    return QuantCodes(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                      torch.cat([p.m for p in parts]), max(p.bits for p in parts),
                      fmts.pop() if len(fmts) == 1 else "+".join(sorted(fmts)))


def from_gguf_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantCodes:
    """Codes of a GGUF tensor's raw blocks (`raw`: its bytes, [N, bytes per row] or flat) of shape [N, K]."""
    if type_name not in GGUF_FORMATS:
        raise ValueError(f"GGUF block type {type_name} is not served quantized here (only {sorted(GGUF_FORMATS)})")
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"a [{n}, {k}] tensor is not whole blocks of {BLOCK}")
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}[type_name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, block_bytes)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        codes = blocks[:, :, 2:].reshape(n, k) ^ np.uint8(0x80)  # int8 q + 128, bit for bit
        m = (d.astype(np.float32) * -128).astype(np.float16)  # exact: a power of two times a fp16
    else:
        first = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[type_name]
        qs = blocks[:, :, first:first + 16]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, k)  # ggml: low nibbles are 0..15
        if type_name == "Q5_0":  # bit i of the little-endian u32 is bit 4 of weight i
            high = np.unpackbits(blocks[:, :, 2:6], axis=2, bitorder="little").reshape(n, k)
            codes = codes | (high << np.uint8(4)).astype(np.uint8)
        if type_name == "Q4_1":
            m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
        else:  # exact: a power of two times a fp16
            m = (d.astype(np.float32) * (-16 if type_name == "Q5_0" else -8)).astype(np.float16)
    return QuantCodes(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(np.ascontiguousarray(d)),
                      torch.from_numpy(np.ascontiguousarray(m)), GGUF_FORMATS[type_name], type_name)


def int8_per_channel(weight: torch.Tensor) -> QuantCodes:  # weight [N, K] float
    """Symmetric int8 with one fp16 scale per output row (K a multiple of 32)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 needs the input width in whole blocks of {BLOCK}, got {k}")
    d = (weight.float().abs().amax(dim=1) / 127).half()  # [N]
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d.float()))
    q = torch.round(weight.float() * inv[:, None]).clamp(-127, 127).to(torch.int16)
    codes = (q + 128).to(torch.uint8)
    d_blocks = d[:, None].expand(n, k // BLOCK).contiguous()
    return QuantCodes(codes, d_blocks, (d_blocks.float() * -128).half(), 8, "int8")


def q4_1_blocks(weight: torch.Tensor) -> QuantCodes:  # weight [N, K] float
    """4-bit codes with a fp16 scale and minimum per block of 32 inputs (GGUF's Q4_1, as llama.cpp's quantize
    makes it, K a multiple of 32). The codes round against the stored fp16 d and m, so they reconstruct the
    weight as the kernel reads it; the block's minimum and maximum are exact up to fp16 rounding."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"4-bit blocks need the input width in whole blocks of {BLOCK}, got {k}")
    w = weight.float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d.float()))
    q = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp(0, 15)
    return QuantCodes(q.to(torch.uint8).reshape(n, k), d, m, 4, "q4_1")


# the formats made at load from a checkpoint's weights (`--quantization`): how each quantizes an [N, K] weight
QUANTIZE_AT_LOAD = {"int8": int8_per_channel, "q4_1": q4_1_blocks}


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's int8 rows: (codes [M, K], scales [M, K / 32], sums [M, K / 32]) (see qgemv_cpu.cpp)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(dim=2) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])  # halves to even, as nearbyint
    return q.to(torch.int8).reshape(m, k), d, d * q.sum(dim=2)


class Dequantizes(Protocol):
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


def qgemv_ref(x: torch.Tensor, w: Dequantizes) -> torch.Tensor:  # [M, K] -> [M, N] float32
    """Dequantize, then matmul, in float64: the rows as the kernel quantizes them (codes times their block's
    scale) against the weight's codes as their format defines them. The kernel's int32 block sums are exact,
    so it differs from this by its fp32 additions only."""
    xq, xd, _ = quantize_rows_ref(x)
    m, k = x.shape
    rows = (xq.reshape(m, k // BLOCK, BLOCK).double() * xd.double()[..., None]).reshape(m, k)
    return (rows @ w.dequantize(torch.float64).T).float()
