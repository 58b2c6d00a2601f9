"""Gemma 4's experts on the CPU: each expert's projections packed for the GEMV kernels, one C++ op a layer.

    checkpoint   gate_up [E, 2I, H], down [E, H, I]   (fp32 or bf16, as the model's dtype)
    packed       gate_up [E, <GEMV pack of [2I, H]>], down [E, <GEMV pack of [H, I]>]
                 fp32: csrc/gemv_cpu.cpp's layout; bf16: csrc/gemv_bf16_cpu.cpp's (half the bytes);
                 int8 (`--quantization int8`, H and I whole blocks of 32): int8 per output channel in
                 csrc/w8a8_cpu.cpp's panels, as the projections are stored (a quarter of fp32's bytes);
                 q4_1 (`--quantization q4_1`, the same widths): 4-bit blocks of 32 with a fp16 scale and minimum
                 each in csrc/qgemv_cpu.cpp's panels (0.625 bytes a weight: 0.16 of fp32's, 0.62 of int8's)
    a layer      torch.ops.baton_cpu.moe_experts (csrc/moe_cpu.cpp): pairs grouped by expert in C++, each expert
                 hit streamed once through the kernel, experts split across the threads

Why: torch's F.linear (MKL) on the few rows each expert gets in a decode step
reads the weights at ~10 GB/s on this machine; the GEMV kernels read them at
DRAM speed (~30 GB/s). One pack replaces the weight (no second copy), and the
kernels serve prefill's larger groups too, eight rows a pass over a panel held
in L2. The result is the reference (`TorchExperts`) to fp32 accumulation-order
noise (fp32), or F.linear against the bf16 weights (bf16; rows rounded to bf16
where the CPU has AVX512-BF16, as the bf16 projections do).
"""

from __future__ import annotations

import torch

from shared.ops.cpu_kernels import cpu_kernels_available
from shared.ops.linear import pack_codes
from shared.ops.quant import BLOCK, QUANTIZE_AT_LOAD

_DTYPES = (torch.float32, torch.bfloat16)
# quantized expert formats: the projections' own (csrc/moe_cpu.cpp's project runs each pack's kernel)
EXPERT_QUANTIZATIONS = tuple(QUANTIZE_AT_LOAD)


def packed_experts_available(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES and cpu_kernels_available()


def quantized_experts_fit(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Both projections' input widths (hidden, intermediate) are whole blocks of the quantized rows' 32."""
    return gate_up.shape[2] % BLOCK == 0 and down.shape[2] % BLOCK == 0


def _pack_one(weight: torch.Tensor, quantization: str) -> torch.Tensor:  # [N, K] -> its kernel's pack
    if quantization in QUANTIZE_AT_LOAD:
        return pack_codes(QUANTIZE_AT_LOAD[quantization](weight))
    if weight.dtype == torch.bfloat16:
        return torch.ops.baton_cpu.gemv_bf16_pack(weight)  # type: ignore[no-any-return]
    return torch.ops.baton_cpu.gemv_pack(weight)  # type: ignore[no-any-return]


def _pack_each(weights: torch.Tensor, quantization: str) -> torch.Tensor:  # [E, N, K] -> [E, <pack of [N, K]>]
    first = _pack_one(weights[0].contiguous(), quantization)
    packed = first.new_empty((weights.shape[0], *first.shape))  # filled in place: never two packed copies
    packed[0] = first
    for e in range(1, weights.shape[0]):
        packed[e] = _pack_one(weights[e].contiguous(), quantization)
    return packed


class PackedExperts:
    """A layer's experts as the CPU GEMV kernels read them (see the module docstring)."""

    def __init__(
        self,
        gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
        down: torch.Tensor,  # [num_experts, hidden, intermediate]
        quantization: str = "none",  # or one of EXPERT_QUANTIZATIONS (quantized_experts_fit must hold)
    ) -> None:
        if not cpu_kernels_available():  # also what loads them, for a caller that did not ask first
            raise RuntimeError("packed experts need the C++ CPU kernels, which did not build (see the log)")
        if gate_up.dtype not in _DTYPES or down.dtype != gate_up.dtype:
            raise ValueError(f"packed experts take float32 or bfloat16 weights, got {gate_up.dtype}, {down.dtype}")
        quantized = quantization != "none"
        if quantized and quantization not in QUANTIZE_AT_LOAD:
            raise ValueError(f"experts quantize to one of {EXPERT_QUANTIZATIONS}, not {quantization!r}")
        if quantized and not quantized_experts_fit(gate_up, down):
            raise ValueError(f"{quantization} experts need hidden and intermediate sizes in whole blocks of {BLOCK}, "
                             f"got {gate_up.shape[2]} and {down.shape[2]}")
        self._num_experts, two_i, self.hidden_size = gate_up.shape
        self.intermediate_size = two_i // 2
        self.gate_up = _pack_each(gate_up, quantization)
        self.down = _pack_each(down, quantization)
        # what a pass over one expert reads: its weights in their dtype; a quantized pack's bytes with their
        # scales (and int8's block offsets)
        self._expert_nbytes = (self.gate_up[0].numel() + self.down[0].numel() if quantized
                               else (gate_up[0].numel() + down[0].numel()) * gate_up.element_size())

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def expert_nbytes(self) -> int:
        return self._expert_nbytes

    def __call__(
        self,
        h: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k] fp32
        index: torch.Tensor,  # [n, top_k] int64
    ) -> torch.Tensor:  # [n, hidden], h's dtype
        out = torch.ops.baton_cpu.moe_experts(h.float().contiguous(), weights.float().contiguous(),
                                              index.contiguous(), self.gate_up, self.down, self.intermediate_size)
        return out.to(h.dtype)
