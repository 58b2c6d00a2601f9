"""How a model's projections are stored: a dtype, or a quantized block format (`--quantization`).

    dtype float32    fp32 (oneDNN, and the fp32 GEMV copy for decode batches)
    dtype bfloat16   bf16 packed for the bf16 GEMV (CPU; on CUDA the model's dtype)
    int8             int8 per channel, quantized at load from the fp32 weights
    q4_1             4-bit blocks of 32 with a scale and minimum each (GGUF's Q4_1), quantized at load;
                     the LM head int8 per channel (llama.cpp's 4-bit files keep theirs at 6 or 8 bits: the
                     logits are where 4-bit error shows most)
    gguf             the GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q8_0; Q4_K, Q6_K), read by
                     shared/models/gguf_weights.py

Quantized formats run on the CPU through `csrc/qgemv_cpu.cpp`, every batch size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from shared.ops.kquant import KQuantCodes
from shared.ops.linear import LinearWeight
from shared.ops.quant import BLOCK as QUANT_BLOCK
from shared.ops.quant import QUANTIZE_AT_LOAD, QuantCodes, int8_per_channel

QUANTIZATIONS = ("none", *QUANTIZE_AT_LOAD, "gguf")


@dataclass(frozen=True)
class WeightFormat:
    dtype: torch.dtype = torch.float32
    quantization: str = "none"  # one of QUANTIZATIONS
    # gguf: our projection names (model.layers.{i}.qkv, ..., lm_head) -> the file's codes
    gguf_codes: Mapping[str, QuantCodes | KQuantCodes] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")

    def linear(self, name: str, weight: torch.Tensor, small_batches: bool) -> LinearWeight:
        """The projection `name` (fp32 `weight` [out, in] as loaded) in this format."""
        if self.quantization == "gguf":
            return LinearWeight.quantized(self.gguf_codes[name])
        if self.quantization in QUANTIZE_AT_LOAD and weight.shape[1] % QUANT_BLOCK == 0:
            quantize = int8_per_channel if name == "lm_head" else QUANTIZE_AT_LOAD[self.quantization]
            return LinearWeight.quantized(quantize(weight))
        # quantized rows are whole blocks of QUANT_BLOCK inputs: a narrower projection (Gemma 4's per-layer input
        # gate, a few dozen columns) stays in the dtype, as llama.cpp keeps its small tensors unquantized
        return LinearWeight(weight, small_batches=small_batches, weight_dtype=self.dtype)

    def describe(self) -> str:
        if self.quantization == "gguf":
            return "GGUF blocks (" + ", ".join(sorted({c.fmt for c in self.gguf_codes.values()})) + ")"
        if self.quantization == "int8":
            return "int8 per channel"
        if self.quantization == "q4_1":
            return "4-bit blocks (Q4_1)"
        return str(self.dtype).removeprefix("torch.")
