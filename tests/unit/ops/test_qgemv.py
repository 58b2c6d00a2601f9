"""The quantized GEMV (`csrc/qgemv_cpu.cpp`) and the block formats it serves (`shared/ops/quant.py`,
`shared/ops/kquant.py`).

Oracles: gguf's own numpy (de)quantizers for the GGUF block layouts, and `qgemv_ref` (dequantize, then matmul in
float64) for the products, at every instruction-set level this CPU runs; the integer block sums make every
level give the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from shared.ops import cpu_isa
from shared.ops.kquant import gguf_codes
from shared.ops.linear import LinearWeight
from shared.ops.quant import (
    QuantCodes,
    concat_rows,
    from_gguf_blocks,
    int8_per_channel,
    q4_1_blocks,
    qgemv_ref,
)

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "int8", "q4_1"]
SHAPES = [(960, 576), (576, 1536), (70, 64), (5, 32)]


def weight_codes(fmt: str, n: int, k: int, seed: int = 0) -> tuple[QuantCodes, torch.Tensor]:
    """(codes, the fp32 weight they quantize)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt in ("int8", "q4_1"):  # made at load from fp32 weights
        return (int8_per_channel(w) if fmt == "int8" else q4_1_blocks(w)), w
    raw = quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
    return from_gguf_blocks(fmt, raw, (n, k)), w


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_gguf_blocks_dequantize_as_gguf_does(fmt: str) -> None:
    n, k = 48, 96
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    raw = quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
    codes = from_gguf_blocks(fmt, raw, (n, k))
    expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(n, k).copy())
    assert torch.equal(codes.dequantize(), expected)  # every format's d * c + m is exact in fp32
    assert int(codes.codes.max()) < (16 if codes.bits == 4 else 256)


def test_int8_per_channel_is_within_half_a_step() -> None:
    w = torch.randn(40, 64)
    codes = int8_per_channel(w)
    step = codes.d.float()[:, :1]
    assert ((codes.dequantize() - w).abs() <= step * 0.5 + 1e-3 * step).all()


def test_q4_1_blocks_are_within_half_a_step_and_no_worse_than_ggufs_quantizer() -> None:
    """--quantization q4_1 makes GGUF's Q4_1 blocks at load: each weight within half its block's step of
    the fp32 value, and the rms error no larger than gguf-py's own Q4_1 quantizer's on the same weights."""
    n, k = 64, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    codes = q4_1_blocks(w)
    assert codes.bits == 4 and int(codes.codes.max()) <= 15
    step = codes.d.float().repeat_interleave(32, dim=1)
    err = codes.dequantize() - w
    # half a step, plus the fp16 rounding of the block's minimum
    assert (err.abs() <= 0.5 * step + codes.m.float().abs().repeat_interleave(32, dim=1) * 2**-10).all()
    theirs = from_gguf_blocks("Q4_1", quants.quantize(w.numpy(), GGMLQuantizationType.Q4_1), (n, k))
    assert err.norm() <= (theirs.dequantize() - w).norm()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_matches_the_reference_at_every_row_count(fmt: str, out_features: int, in_features: int,
                                                  isa_level: str) -> None:
    codes, w = weight_codes(fmt, out_features, in_features)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(19, in_features, generator=torch.Generator().manual_seed(2))
    batched = lin(x)
    ref = qgemv_ref(x, codes)
    torch.testing.assert_close(batched, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # quantized activations and weights stay close to the fp32 product (4 bits: ~12% rms for Gaussian weights)
    exact = x @ w.T
    assert (batched - exact).norm() < {4: 0.2, 5: 0.1, 8: 0.03}[codes.bits] * exact.norm()
    for rows in (1, 2, 3, 8, 9):
        assert torch.equal(lin(x[:rows]), batched[:rows]), rows


@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_0", "Q8_0"])
def test_every_level_gives_the_same_bits(fmt: str) -> None:
    codes, _ = weight_codes(fmt, 200, 576, seed=3)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(10, 576, generator=torch.Generator().manual_seed(4))
    results = {}
    for level in cpu_isa.ISA_LEVELS:
        if cpu_isa.isa_supported(level):
            with cpu_isa.use_isa(level):
                results[level] = lin(x)
    first = next(iter(results.values()))
    assert all(torch.equal(r, first) for r in results.values()), list(results)


def test_rows_of_several_weights_concatenate() -> None:
    a, _ = weight_codes("Q4_1", 32, 64, seed=5)
    b, _ = weight_codes("Q4_1", 16, 64, seed=6)
    both = concat_rows([a, b])
    assert both.fmt == "Q4_1" and torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    x = torch.randn(3, 64)
    assert torch.equal(LinearWeight.quantized(both)(x)[:, :32], LinearWeight.quantized(a)(x))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="Q6_K"):
        from_gguf_blocks("Q6_K", np.zeros(210, dtype=np.uint8), (1, 256))
    with pytest.raises(ValueError, match="super-blocks"):
        gguf_codes("Q6_K", np.zeros(210, dtype=np.uint8), (2, 128))
    with pytest.raises(ValueError, match="blocks"):
        int8_per_channel(torch.randn(4, 40))
    with pytest.raises(ValueError, match="blocks"):
        q4_1_blocks(torch.randn(4, 40))
    codes, _ = weight_codes("Q8_0", 16, 64)
    packed = codes.pack()
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.baton_cpu.qgemv(torch.randn(1, 96), packed, 16)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.baton_cpu.qgemv(torch.randn(1, 64), packed[:, :, :-1].contiguous(), 16)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.baton_cpu.qgemv(torch.randn(1, 64), packed, 40)
    with pytest.raises(RuntimeError, match="codes above 31"):
        torch.ops.baton_cpu.qgemv_pack(torch.full((16, 32), 32, dtype=torch.uint8), codes.d[:, :1], codes.m[:, :1], 5)
