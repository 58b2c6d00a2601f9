"""What an engine stores weights and KV in, and computes in: vLLM's `--dtype` and `--kv-cache-dtype`.

    --dtype           auto | float32 | bfloat16 | float16
    --kv-cache-dtype  auto | float32 | bfloat16 | fp8 | fp8_e4m3 | fp8_e5m2

On the CPU the activations stay fp32 and `dtype` names how the projections'
weights are stored: bfloat16 halves the bytes a decode step streams and runs
the C++ bf16 kernels (`csrc/gemv_bf16_cpu.cpp`: vdpbf16ps on AVX512-BF16, the
weights widened in registers below it). float16 has no CPU kernel and runs the
whole model in float16 through torch, as on CUDA, where `dtype` is the dtype
the whole model computes in.

`auto` picks the fastest setting whose fidelity bound holds (bf16 perplexity
within 1% of fp32; bench/fidelity.py measures it): bfloat16 on CUDA and on CPUs
whose kernels run vdpbf16ps (AVX512-BF16 or AMX), float32 on other CPUs, where
widening bf16 saves bytes but costs the batched steps their arithmetic speed.
The KV cache's `auto` is the weights' dtype. `fp8` (e4m3, as vLLM's) and
`fp8_e5m2` store a byte a value with no scale (shared/kv/cache_dtype.py): half
the bytes decode attention streams from a bf16 cache, widened to fp32 as the
kernels read them. CPU only: on CUDA the cache keeps the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kv.cache_dtype import FP8_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", *FP8_DTYPES)


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # activations, norms, attention arithmetic
    weights: torch.dtype  # how projections are stored
    kv_cache: torch.dtype

    def describe(self) -> str:
        def name(d: torch.dtype) -> str:
            return str(d).removeprefix("torch.")

        return f"weights {name(self.weights)}, KV cache {name(self.kv_cache)}, activations {name(self.compute)}"


def auto_dtype(device: str) -> str:
    """`--dtype auto`'s choice on this device (see the module docstring)."""
    if device.startswith("cuda"):
        return "bfloat16"
    from shared.ops.cpu_isa import isa_supported
    from shared.ops.cpu_kernels import cpu_kernels_available

    if cpu_kernels_available() and isa_supported("avx512_bf16"):
        return "bfloat16"
    return "float32"


def resolve_precision(dtype: str, kv_cache_dtype: str, device: str) -> Precision:
    """The precision `--dtype` and `--kv-cache-dtype` name on `device` (`auto` resolved)."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {kv_cache_dtype!r}")
    weights = DTYPES[auto_dtype(device) if dtype == "auto" else dtype]
    on_cpu = not device.startswith("cuda")
    # on the CPU only bf16 has weight kernels under fp32 activations; anything else computes in its dtype
    compute = torch.float32 if on_cpu and weights == torch.bfloat16 else weights
    kv = weights if kv_cache_dtype == "auto" else {**DTYPES, **FP8_DTYPES}[kv_cache_dtype]
    if not on_cpu and kv != compute:
        raise ValueError(f"on CUDA the KV cache is kept in the model's dtype ({compute}), not {kv}")
    if compute == torch.float16 and kv != torch.float16:
        raise ValueError("a float16 model keeps a float16 KV cache")
    return Precision(compute=compute, weights=weights, kv_cache=kv)
