"""The few-row GEMV kernel (shared/ops/triton_gemv.py) against the torch ops it folds together.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors. fp32 must agree with the references to
summation order; bf16 within a few bf16 steps of each output row's largest value (the interpreter truncates
each cast where a GPU rounds to nearest even, and the gated form rounds four times).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from shared.models.common import rms_norm, rms_norm_offset
from shared.ops.silu_mul_cpu import silu_mul_ref
from tests.helpers.tolerance import assert_kernel_close

tg = importlib.import_module("shared.ops.triton_gemv")
assert tg.triton_available(), "triton does not run here (neither CUDA nor its interpreter)"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_STEPS = 3 if DEVICE == "cuda" else 6


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_kernel_close(got, want, 2e-5, BF16_STEPS)


def _case(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEVICE, dtype)
    norm = (torch.randn(k, generator=g) * 0.2 + 1).to(DEVICE, dtype)
    residual = torch.randn(rows, n if n % 2 else n // 2, generator=g).to(DEVICE, dtype)
    return x, weight, norm, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_plain_and_residual(dtype: torch.dtype, rows: int) -> None:
    x, weight, _, _ = _case(rows, 200, 37, dtype)  # K and N not multiples of the tiles
    residual = torch.randn(rows, 37).to(DEVICE, dtype)
    _close(tg.gemv(x, weight), x @ weight.T)
    _close(tg.gemv(x, weight, residual=residual), residual + x @ weight.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_norm_prologue(dtype: torch.dtype, gemma: bool) -> None:
    x, weight, norm, _ = _case(3, 576, 96, dtype, seed=1)
    reference = rms_norm_offset if gemma else rms_norm
    _close(tg.gemv(x, weight, norm_weight=norm, eps=1e-5, norm_in_fp32=gemma), reference(x, norm, 1e-5) @ weight.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_with_norm(dtype: torch.dtype) -> None:
    x, gate_up, norm, _ = _case(4, 130, 2 * 40, dtype, seed=2)
    got = tg.gemv(x, gate_up, norm_weight=norm, eps=1e-6, gated=True)
    _close(got, silu_mul_ref(rms_norm(x, norm, 1e-6) @ gate_up.T))


def test_rejects_what_it_would_misread() -> None:
    x, weight, _, _ = _case(17, 64, 32, torch.float32)
    with pytest.raises(AssertionError):
        tg.gemv(x, weight)  # more rows than one tile
    with pytest.raises(AssertionError):
        tg.gemv(x[:2], weight.to(torch.bfloat16))
    assert tg.gemv(x[:0], weight).shape == (0, 32)
