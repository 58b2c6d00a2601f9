"""`--dtype` / `--kv-cache-dtype` resolved per device (shared/engine/precision.py)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.precision import auto_dtype, resolve_precision
from shared.ops import cpu_isa

BF16 = torch.bfloat16


def test_bf16_on_the_cpu_stores_weights_and_kv_in_bf16_and_computes_in_fp32() -> None:
    p = resolve_precision("bfloat16", "auto", "cpu")
    assert (p.weights, p.kv_cache, p.compute) == (BF16, BF16, torch.float32)
    assert p.describe() == "weights bfloat16, KV cache bfloat16, activations float32"
    assert resolve_precision("float32", "bfloat16", "cpu").kv_cache == BF16
    assert resolve_precision("bfloat16", "float32", "cpu").kv_cache == torch.float32


def test_cuda_computes_in_its_dtype_and_keeps_the_kv_in_it() -> None:
    p = resolve_precision("auto", "auto", "cuda")
    assert (p.weights, p.kv_cache, p.compute) == (BF16, BF16, BF16)
    with pytest.raises(ValueError, match="CUDA"):
        resolve_precision("bfloat16", "float32", "cuda")


def test_auto_picks_bf16_where_the_kernels_run_vdpbf16ps() -> None:
    expected = "bfloat16" if cpu_isa.isa_supported("avx512_bf16") else "float32"
    assert auto_dtype("cpu") == expected
    assert resolve_precision("auto", "auto", "cpu").weights == (BF16 if expected == "bfloat16" else torch.float32)


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        resolve_precision("int3", "auto", "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="float16"):
        resolve_precision("float16", "bfloat16", "cpu")
    assert EngineConfig(dtype="auto").precision == resolve_precision("auto", "auto", "cpu")


def test_an_fp8_kv_cache_is_vllms_spelling_on_the_cpu_only() -> None:
    """`fp8` is e4m3 (vLLM's default fp8), `fp8_e5m2` the other; CUDA keeps the model's dtype."""
    assert resolve_precision("auto", "fp8", "cpu").kv_cache == torch.float8_e4m3fn
    assert resolve_precision("float32", "fp8_e4m3", "cpu").kv_cache == torch.float8_e4m3fn
    p = resolve_precision("bfloat16", "fp8_e5m2", "cpu")
    assert (p.weights, p.kv_cache, p.compute) == (BF16, torch.float8_e5m2, torch.float32)
    assert p.describe() == "weights bfloat16, KV cache float8_e5m2, activations float32"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_precision("bfloat16", "fp8", "cuda")
