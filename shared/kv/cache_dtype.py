"""What a KV cache may be stored in, and how values are rounded into it.

fp32 and bf16 caches hold the keys as torch rounds them (`Tensor.to`). An 8-bit
cache (vLLM's `--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`) holds float8 bits
with no scale, as vLLM's CPU and default CUDA paths do (a scale of 1.0): a
value past the format's largest finite one is stored as that one (torch
saturates e4m3 but makes e5m2 infinite; a cache must never hold an inf that
the softmax turns into NaN), so both are clamped first. The CPU kernels round
the same way to the same bits (`csrc/fp8.h`).

Hidden states a handoff carries for a speculative draft travel in the KV dtype
when it is 16 bits or more, else in bf16: three mantissa bits would change
what the draft proposes.
"""

from __future__ import annotations

import torch

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,  # vLLM's `fp8`: e4m3
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded into a cache of `dtype` (saturating for float8: 448 for e4m3, 57344 for e5m2)."""
    if x.dtype == dtype:
        return x
    if dtype in FP8_DTYPES.values():  # torch makes e5m2 inf past its largest: a cache must not hold one
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def hidden_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """What a handoff's hidden states travel in beside a cache of `kv_dtype`."""
    return torch.bfloat16 if kv_dtype.itemsize < 2 else kv_dtype
