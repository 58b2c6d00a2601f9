"""Dense projections with weights stored the way the device multiplies them fastest.

On x86 CPUs torch's default `F.linear` goes through MKL, whose small-batch
path is slow on AMD parts (we measured 6.7 GB/s effective at batch 16 and 13
GB/s at batch 1 against 32 GB/s of DRAM bandwidth). oneDNN with the weight
reordered once into its blocked layout reaches ~1.7x that at every decode batch
size. Elsewhere (CUDA, or a torch without oneDNN) the plain weight is used.

At decode batch sizes oneDNN is still slow: at one row it streams SmolLM2's
weights at 18-27 GB/s. `csrc/gemv_cpu.cpp` reads them at 32-35 GB/s (DRAM speed)
from a second copy in its own layout. All projections of a decode step
(`bench/linear.py`): on AVX2 1.36x less time at 1 row, 1.14x at 16, the same at
32; on AVX-512 (Zen 4, 8-row passes) 2.7x at 1 row, 1.5x at 8, 1.2x at 16, 1.1x
at 32 and 64. It
sums every output in oneDNN's order, so a row gives the same bits through
either path and a request the same tokens alone or in a batch. oneDNN's K
blocking (where its sums restart) depends on the CPU and the weight, so each
weight is probed when it is packed with the blockings seen so far
(`_ONEDNN_K_BLOCKS`) and keeps the one that gives oneDNN's bits; a weight
where none does keeps oneDNN alone (and the copy is dropped).
The copy doubles the projections' memory (prefill engines keep it for the LM
head only); `BATON_CPU_GEMV=0` turns it off.

The reference is `F.linear` on the original weight; results agree to fp32
accumulation-order noise (tested).

bf16 weights (`weight_dtype=torch.bfloat16`, on the CPU) keep only a packed
bf16 copy (`csrc/gemv_bf16_cpu.cpp`) that serves every batch size: half the
bytes a decode step streams, vdpbf16ps where the CPU has AVX512-BF16 (rows
rounded to bf16), weights widened to fp32 in registers below it. Its reference
is `F.linear` against the bf16-rounded weight.

Quantized weights (`LinearWeight.quantized`: GGUF Q4_0 / Q4_1 / Q5_0 / Q8_0
blocks and Q4_K / Q6_K super-blocks as the file holds them; `shared/ops/quant.py`,
`shared/ops/kquant.py`) keep only the kernel's packed blocks
(`csrc/qgemv_cpu.cpp`), for every batch size. int8 per channel keeps only its
W8A8 panels (`shared/ops/w8a8.py`): rows quantized per row, integer sums.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from shared.ops import w8a8
from shared.ops.cpu_kernels import cpu_has_avx512, cpu_kernels_available
from shared.ops.quant import QuantCodes

if TYPE_CHECKING:
    from shared.ops.kquant import KQuantCodes

logger = logging.getLogger(__name__)

# oneDNN picks its blocking for this many rows; decode batches and prefill chunks both run well
_ONEDNN_BATCH_HINT = 128
# Up to this many rows the GEMV kernel runs: on AVX2 oneDNN is as fast by 32 rows; on AVX-512 the kernel's
# 8-row passes still beat it at 64 (bench/linear.py)
GEMV_MAX_ROWS = 64 if cpu_has_avx512() else 16
# Where oneDNN's fp32 sums restart (in inputs), measured at 2..256 rows: 1024 on AVX2-only EPYCs; on
# AVX-512 (Zen 4) 512 for in_features <= 1024 and 1024 above. (At one row AVX-512 oneDNN sums K > 1024
# in yet another order, so without the kernel a lone row there differs from its batched self.)
_ONEDNN_K_BLOCKS = (1024, 512)


def onednn_available(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def gemv_enabled() -> bool:
    return os.environ.get("BATON_CPU_GEMV", "1") != "0" and cpu_kernels_available()


def pack_codes(codes: QuantCodes | KQuantCodes) -> torch.Tensor:
    """Codes in the layout of the kernel that serves them: int8 per channel as W8A8 panels (int8), every block
    format as qgemv's panels (uint8). The packs' dtypes are how the kernels' callers tell them apart
    (LinearWeight, csrc/moe_cpu.cpp)."""
    if isinstance(codes, QuantCodes) and codes.fmt == "int8":
        return w8a8.pack(codes)
    return codes.pack()


class LinearWeight:
    """`y = x @ W.T` for a fixed weight W [out_features, in_features]."""

    def __init__(self, weight: torch.Tensor, backend: str = "auto", small_batches: bool = True,
                 weight_dtype: torch.dtype = torch.float32) -> None:
        """`small_batches`: keep the GEMV copy (where the kernel runs); False where the weight only ever
        sees large batches (prefill engines' projections), which saves the memory at no change in result.
        `weight_dtype` bfloat16: store the weight as bf16 for the bf16 kernel (CPU; elsewhere, or where the
        kernels did not build, the weight stays as given)."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.gemv: torch.Tensor | None = None
        self.gemv_k_block = 0
        if weight_dtype == torch.bfloat16 and backend == "auto" and weight.device.type == "cpu" and gemv_enabled():
            self.backend = "gemv_bf16"
            self.weight = torch.ops.baton_cpu.gemv_bf16_pack(weight.contiguous())
            return
        if weight_dtype not in (torch.float32, weight.dtype):
            logger.warning("no %s kernel for a [%d, %d] weight here: keeping it as %s", weight_dtype,
                           self.out_features, self.in_features, weight.dtype)
        use_onednn = backend == "onednn" or (
            backend == "auto" and weight.dtype == torch.float32 and onednn_available(weight.device)
        )
        self.backend = "onednn" if use_onednn else "torch"
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ONEDNN_BATCH_HINT)
            if use_onednn
            else weight.contiguous()
        )
        # the GEMV copy for small batches, only beside oneDNN (whose sums it reproduces)
        if use_onednn and backend == "auto" and small_batches and gemv_enabled():
            self._pack_gemv(weight)

    @classmethod
    def quantized(cls, codes: QuantCodes | KQuantCodes) -> LinearWeight:
        """A weight served in its block format by the quantized GEMV kernel (needs the CPU kernels)."""
        if not cpu_kernels_available():
            raise RuntimeError("quantized weights need the C++ CPU kernels, which did not build (see the log)")
        self = cls.__new__(cls)
        self.out_features, self.in_features = codes.codes.shape
        self.gemv, self.gemv_k_block = None, 0
        self.weight = pack_codes(codes)
        self.backend = "w8a8" if self.weight.dtype == torch.int8 else "qgemv"
        return self

    def _pack_gemv(self, weight: torch.Tensor) -> None:
        packed = torch.ops.baton_cpu.gemv_pack(weight.contiguous())
        # oneDNN's bits where it serves (more rows than the kernel takes); the kernel sums each output the
        # same way whatever the row count, so three rows check its order
        probe = torch.randn(GEMV_MAX_ROWS + 1, self.in_features, generator=torch.Generator().manual_seed(0))
        expected = self._onednn(probe)[:3]
        for k_block in _ONEDNN_K_BLOCKS:
            if torch.equal(torch.ops.baton_cpu.gemv(probe[:3], packed, self.out_features, k_block), expected):
                self.gemv, self.gemv_k_block = packed, k_block
                return
        logger.warning("GEMV kernel sums a [%d, %d] weight in another order than oneDNN: oneDNN only",
                       self.out_features, self.in_features)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:  # its one-row kernel may sum in another order than 2+ rows (AVX-512): two rows
            return torch.ops.mkldnn._linear_pointwise(x.repeat(2, 1), self.weight, None, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in_features] -> [n, out_features]
        assert x.dim() == 2 and x.shape[1] == self.in_features, f"got {tuple(x.shape)}"
        if self.backend == "gemv_bf16":
            return torch.ops.baton_cpu.gemv_bf16(x.float().contiguous(), self.weight, self.out_features)
        if self.backend == "qgemv":
            return torch.ops.baton_cpu.qgemv(x.float().contiguous(), self.weight, self.out_features)
        if self.backend == "w8a8":
            return torch.ops.baton_cpu.w8a8(x.float().contiguous(), self.weight, self.out_features)
        if self.backend == "onednn":
            if self.gemv is not None and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.float32:
                return torch.ops.baton_cpu.gemv(x.contiguous(), self.gemv, self.out_features, self.gemv_k_block)
            return self._onednn(x.contiguous())
        return F.linear(x, self.weight)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:  # [n, in_features] -> [n, out_features // 2]
        """silu(gate) * up of this gate_up projection (gate's outputs first, then up's), with the bits of
        silu_mul_cpu over its output: one op for the bf16 kernel and for W8A8, which run it as one pass (the
        [n, out_features] projection never reaches memory) on AMX tiles at any n and elsewhere for prompt chunks
        (csrc/gemv_bf16_cpu.cpp, csrc/w8a8_cpu.cpp), else the projection and then silu_mul."""
        if self.backend == "gemv_bf16":
            return torch.ops.baton_cpu.gemv_bf16_silu(  # type: ignore[no-any-return]
                x.float().contiguous(), self.weight, self.out_features)
        if self.backend == "w8a8":
            return torch.ops.baton_cpu.w8a8_silu(  # type: ignore[no-any-return]
                x.float().contiguous(), self.weight, self.out_features)
        return torch.ops.baton_cpu.silu_mul(self(x))  # type: ignore[no-any-return]

    @property
    def packed(self) -> torch.Tensor | None:
        """The weight as the C++ layer loop's projections take it: the bf16, quantized or W8A8 pack, or the fp32
        GEMV copy."""
        return self.weight if self.backend in ("gemv_bf16", "qgemv", "w8a8") else self.gemv

    @property
    def nbytes(self) -> int:
        """Bytes a pass over the weight reads (codes and block scales for a quantized one)."""
        if self.backend in ("qgemv", "w8a8"):
            return self.weight.numel()
        return self.out_features * self.in_features * self.weight.element_size()
