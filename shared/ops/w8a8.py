"""int8-per-channel weights times rows quantized to int8 per block of 32 (`csrc/w8a8_cpu.cpp`), and its
reference.

`--quantization int8` stores each projection as int8 per output channel
(`shared/ops/quant.py: int8_per_channel`). The rows are quantized as qgemv
quantizes them (llama.cpp's Q8_0 activations), so the numbers are int8's as
before; what changes is the loop: with one weight scale per channel, a block of
32 inputs is vpdpbusd alone (64 multiply-adds an instruction, twice vdpbf16ps's)
and one convert and FMA, where qgemv's generic block formats left int8 no faster
than bf16 at the batch sizes a server runs (`bench/linear.py`).
"""

from __future__ import annotations

import torch

from shared.ops.quant import BLOCK, QuantCodes, quantize_rows_ref


def pack(codes: QuantCodes) -> torch.Tensor:
    """The kernel's int8 panels (layout in csrc/w8a8_cpu.cpp) of an int8-per-channel weight."""
    if codes.fmt != "int8":
        raise ValueError(f"W8A8 serves int8 per channel, not {codes.fmt}")
    return torch.ops.baton_cpu.w8a8_pack(codes.codes, codes.d[:, 0].float())  # type: ignore[no-any-return]


def w8a8_ref(x: torch.Tensor, codes: QuantCodes) -> torch.Tensor:  # [M, K] -> [M, N] float32
    """The kernel's sum: each block's integer sum (here in int64), folded over the blocks in order with one
    rounding to fp32 a step (the kernel's FMA; float64 here, so it may differ from the kernel in the last
    bit), then times the channel's scale."""
    q, d, _ = quantize_rows_ref(x)
    m, k = x.shape
    w = codes.codes.to(torch.int64) - 128
    acc = torch.zeros(m, w.shape[0], dtype=torch.float32)
    for b in range(k // BLOCK):
        cols = slice(b * BLOCK, (b + 1) * BLOCK)
        sums = q[:, cols].to(torch.int64) @ w[:, cols].T
        acc = (sums.double() * d[:, b, None].double() + acc.double()).float()
    return acc * codes.d[:, 0].float()[None, :]
