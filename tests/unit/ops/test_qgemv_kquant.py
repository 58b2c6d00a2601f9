"""GGUF's K-quant super-blocks (Q4_K, Q6_K) through the quantized GEMV (`shared/ops/kquant.py`,
`csrc/qgemv_cpu.cpp`).

gguf has no quantizer for them, so the weights are random super-blocks (any bytes are a valid block once its
fp16 scales are finite): gguf's numpy dequantizer is the oracle of our reading of the bytes, and `qgemv_ref`
(dequantize the weight and the kernel's int8 rows, matmul in float64) of the kernel, at every
instruction-set level this CPU runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from shared.ops import cpu_isa
from shared.ops.kquant import K_FORMATS, KQuantCodes, concat_codes, gguf_codes
from shared.ops.linear import LinearWeight
from shared.ops.quant import from_gguf_blocks, qgemv_ref

SHAPES = [(640, 1024), (70, 256), (17, 2048)]


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k / 256 * block bytes] u8: random codes and sub-scales, fp16 scales of a trained model's size."""
    rng = np.random.default_rng(seed)
    block_bytes = K_FORMATS[fmt][1]
    raw = rng.integers(0, 256, size=(n, k // 256, block_bytes), dtype=np.uint8)
    scale = rng.uniform(1e-4, 2e-3, size=(n, k // 256, 2)).astype(np.float16).view(np.uint8)
    if fmt == "Q4_K":
        raw[:, :, 0:4] = scale.reshape(n, k // 256, 4)  # d, dmin
    else:
        raw[:, :, 208:210] = scale[:, :, 0:2]  # d
    return raw.reshape(n, -1)


def kcodes(fmt: str, n: int, k: int, seed: int = 0) -> tuple[KQuantCodes, np.ndarray]:
    raw = random_blocks(fmt, n, k, seed)
    codes = gguf_codes(fmt, raw, (n, k))
    assert isinstance(codes, KQuantCodes)
    return codes, raw


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_super_blocks_dequantize_as_gguf_does(fmt: str) -> None:
    codes, raw = kcodes(fmt, 48, 512, seed=1)
    expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(48, 512).copy())
    assert torch.equal(codes.dequantize(), expected)
    assert int(codes.codes.max()) < 2 ** codes.bits


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_matches_dequantize_then_matmul(fmt: str, out_features: int, in_features: int, isa_level: str) -> None:
    codes, _ = kcodes(fmt, out_features, in_features)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(19, in_features, generator=torch.Generator().manual_seed(2))
    batched = lin(x)
    ref = qgemv_ref(x, codes)
    torch.testing.assert_close(batched, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # int8 rows against fp32 rows: close to the weight's own product
    exact = x @ codes.dequantize().T
    assert (batched - exact).norm() < 0.02 * exact.norm()
    for rows in (1, 2, 3, 8, 9):
        assert torch.equal(lin(x[:rows]), batched[:rows]), rows


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_every_level_gives_the_same_bits(fmt: str) -> None:
    codes, _ = kcodes(fmt, 200, 512, seed=3)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(10, 512, generator=torch.Generator().manual_seed(4))
    results = {}
    for level in cpu_isa.ISA_LEVELS:
        if cpu_isa.isa_supported(level):
            with cpu_isa.use_isa(level):
                results[level] = lin(x)
    first = next(iter(results.values()))
    assert all(torch.equal(r, first) for r in results.values()), list(results)


def test_rows_of_one_format_concatenate_and_formats_do_not_mix() -> None:
    a, _ = kcodes("Q4_K", 32, 256, seed=5)
    b, _ = kcodes("Q4_K", 16, 256, seed=6)
    both = concat_codes([a, b])
    assert both.fmt == "Q4_K" and torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    x = torch.randn(3, 256)
    assert torch.equal(LinearWeight.quantized(both)(x)[:, :32], LinearWeight.quantized(a)(x))
    six, _ = kcodes("Q6_K", 16, 256, seed=7)
    q5 = from_gguf_blocks("Q5_0", quants.quantize(np.ones((16, 256), np.float32), GGMLQuantizationType.Q5_0),
                          (16, 256))
    for mixed in ([a, six], [a, q5]):
        with pytest.raises(ValueError, match="cannot share"):
            concat_codes(mixed)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="Q5_K"):
        gguf_codes("Q5_K", np.zeros(176, dtype=np.uint8), (1, 256))
    codes, _ = kcodes("Q6_K", 16, 256)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.baton_cpu.qgemv_pack_k(codes.codes, codes.d, codes.dmin, codes.scales.view(torch.uint8),
                                         codes.mins, 6)
    with pytest.raises(RuntimeError, match="codes above 63"):
        torch.ops.baton_cpu.qgemv_pack_k(codes.codes | 64, codes.d, codes.dmin, codes.scales, codes.mins, 6)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.baton_cpu.qgemv(torch.randn(1, 512), codes.pack(), 16)
