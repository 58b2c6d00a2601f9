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


# products summed in registers (the batch-1 form): narrow programs, K in one tile or several, 1 to 5 rows
ROW_CONFIGS = [tg.GemvConfig(block_n=2, block_k=1024, num_warps=2, num_stages=1, dot=False),
               tg.GemvConfig(block_n=8, block_k=64, num_warps=4, num_stages=2, dot=False)]


@pytest.mark.parametrize("config", ROW_CONFIGS, ids=["narrow-one-tile", "k-tiles"])
@pytest.mark.parametrize("rows", [1, 5])
def test_row_products_fold_the_same_ops(config: object, rows: int) -> None:
    x, gate_up, norm, residual = _case(rows, 200, 2 * 37, torch.float32, seed=3)
    weight = gate_up[:37]
    _close(tg.gemv(x, weight, residual=residual[:, :37], config=config), residual[:, :37] + x @ weight.T)
    _close(tg.gemv(x, gate_up, norm_weight=norm, eps=1e-6, gated=True, config=config),
           silu_mul_ref(rms_norm(x, norm, 1e-6) @ gate_up.T))
    xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    _close(tg.gemv(xb, wb, norm_weight=norm.to(torch.bfloat16), eps=1e-6, config=config),
           rms_norm(xb, norm.to(torch.bfloat16), 1e-6) @ wb.T)


def test_tuned_tilings_are_looked_up_by_shape_and_rows() -> None:
    best = {"o@1": {"n": 576, "k": 576, "gated": False, "config": {**ROW_CONFIGS[0].__dict__}},
            "o@8": {"n": 576, "k": 576, "gated": False,
                    "config": {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2, "dot": True}}}
    old = tg.use_tuned_table(tg.tuned_table(best))
    try:
        assert tg.config_for(1, 576, 576, False) == ROW_CONFIGS[0]
        assert tg.config_for(5, 576, 576, False).block_n == 32 == tg.config_for(16, 576, 576, False).block_n
        # another shape: one row in registers, K in one tile; more rows on the tensor cores
        assert tg.config_for(1, 576, 576, True) == tg.one_row_config(576) == tg.GemvConfig(4, 1024, 4, 1, dot=False)
        assert tg.config_for(1, 3000, 4096, False).block_k == 2048
        assert tg.config_for(2, 576, 576, True) == tg.DEFAULT_CONFIG
    finally:
        tg.use_tuned_table(old)


def test_the_committed_tilings_are_valid_for_the_shapes_they_name() -> None:
    """Each GPU's table in triton_gemv_tuned.json parses, and each tiling runs its shape (here, through the
    interpreter at one row) to the same result as the default tiling."""
    import json

    tables = {device: tg.tuned_table(best) for device, best in json.loads(tg.TUNED_FILE.read_text()).items()
              if not device.startswith("_")}
    assert tables and all(tables.values())
    for table in tables.values():
        for (n, k, gated, rows), config in table.items():
            assert config.block_n >= 16 or not config.dot, config
            if rows == 1 and n <= 960:  # the interpreter is slow: the smaller projections
                x, weight, _, _ = _case(1, k, 2 * n if gated else n, torch.float32, seed=n)
                _close(tg.gemv(x, weight, gated=gated, config=config), tg.gemv(x, weight, gated=gated,
                                                                             config=tg.DEFAULT_CONFIG))


def test_rejects_what_it_would_misread() -> None:
    x, weight, _, _ = _case(17, 64, 32, torch.float32)
    with pytest.raises(AssertionError):
        tg.gemv(x, weight)  # more rows than one tile
    with pytest.raises(AssertionError):
        tg.gemv(x[:2], weight.to(torch.bfloat16))
    assert tg.gemv(x[:0], weight).shape == (0, 32)
    with pytest.raises(AssertionError):  # tensor-core tiles are 16 columns wide at least
        tg.gemv(x[:2], weight, config=tg.GemvConfig(block_n=8))
