"""How close a kernel's output must be to the torch ops it replaces, in fp32 and in bf16."""

from __future__ import annotations

import torch


def assert_kernel_close(got: torch.Tensor, want: torch.Tensor, fp32_tol: float, bf16_steps: float) -> None:
    """fp32: within `fp32_tol` (relative and absolute). bf16: within `bf16_steps` steps of bf16's 8-bit mantissa
    (2^-7 each) at the row's largest magnitude, since a sum that cancels keeps its terms' rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=fp32_tol, atol=fp32_tol)
        return
    scale = torch.maximum(got.float().abs(), want.float().abs()).amax(-1, keepdim=True)
    err = (got.float() - want.float()).abs()
    assert (err <= bf16_steps * 2.0 ** -7 * scale).all(), err.max()
