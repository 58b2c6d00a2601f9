"""The bf16-weight GEMV (`csrc/gemv_bf16_cpu.cpp`) against `F.linear` on the bf16-rounded weight, at every
instruction-set level this CPU runs (vdpbf16ps from avx512_bf16 up, which also rounds the rows to bf16;
weights widened in registers below it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.ops import cpu_isa
from shared.ops.linear import LinearWeight
from tests.helpers.torch_threads import torch_threads

# SmolLM2's and Gemma 3's projection shapes, an LM-head slice, and odd shapes (a padded panel, an odd K)
SHAPES = [(960, 576), (3072, 576), (576, 1536), (1536, 640), (640, 2048), (4096, 576), (70, 33), (5, 7)]


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [n, K], [N, K] -> [n, N]
    """What the active level computes, in fp64: rows rounded to bf16 where vdpbf16ps runs."""
    rows = x.bfloat16() if cpu_isa.isa_at_least("avx512_bf16") else x
    return F.linear(rows.double(), w.bfloat16().double())


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_matches_the_reference_at_every_row_count(out_features: int, in_features: int, isa_level: str) -> None:
    g = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(40, in_features, generator=g)
    lin = LinearWeight(w, weight_dtype=torch.bfloat16)
    assert lin.backend == "gemv_bf16" and lin.weight.dtype == torch.bfloat16
    batched = lin(x)
    ref = reference(x, w)
    # fp32 sums of exact products (bf16 x bf16, or bf16 x fp32 widened): the order is the only difference
    tol = 2e-6 * in_features ** 0.5 * ref.abs().max().item()
    assert (batched.double() - ref).abs().max().item() <= tol
    for rows in (1, 2, 3, 7, 8, 9, 17):  # batch invariance: a row's bits do not depend on the others
        assert torch.equal(lin(x[:rows]), batched[:rows]), rows


# (96, 576): one panel block; (2000, 1536): blocks of 10 panels on amx, a half panel last, rows padded to an odd
# number of cache lines; (1000, 1000): every panel's last pairs from a zero-padded tail tile
CHUNK_SHAPES = [(96, 576), (2000, 1536), (1000, 1000)]


@pytest.mark.parametrize(("out_features", "in_features"), CHUNK_SHAPES, ids=[f"{o}x{i}" for o, i in CHUNK_SHAPES])
def test_a_prompt_chunk_of_rows(out_features: int, in_features: int, isa_level: str) -> None:
    """A prompt chunk's rows (many passes of two row tiles on amx, and a partial one): the same sums."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    lin = LinearWeight(w, weight_dtype=torch.bfloat16)
    x = torch.randn(601, in_features, generator=g)
    batched = lin(x)
    ref = reference(x, w)
    assert (batched.double() - ref).abs().max().item() <= 2e-6 * in_features ** 0.5 * ref.abs().max().item()
    assert torch.equal(lin(x[450:455]), batched[450:455])
    assert torch.equal(lin(x[:1]), batched[:1])


@pytest.mark.parametrize("threads", [1, 3])
def test_bits_do_not_depend_on_threads(threads: int, isa_level: str) -> None:
    g = torch.Generator().manual_seed(5)
    lin = LinearWeight(torch.randn(3072, 576, generator=g), weight_dtype=torch.bfloat16)
    x = torch.randn(9, 576, generator=g)
    with torch_threads(2):
        two = lin(x)
    with torch_threads(threads):
        assert torch.equal(lin(x), two)


def test_half_the_bytes_of_fp32() -> None:
    w = torch.randn(960, 576)
    assert LinearWeight(w, weight_dtype=torch.bfloat16).nbytes * 2 == LinearWeight(w).nbytes


def test_kernel_rejects_a_mismatched_weight() -> None:
    packed = torch.ops.baton_cpu.gemv_bf16_pack(torch.randn(64, 96))
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.baton_cpu.gemv_bf16(torch.randn(1, 80), packed, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.baton_cpu.gemv_bf16(torch.randn(1, 96), packed, 100)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.baton_cpu.gemv_bf16(torch.randn(1, 96).bfloat16(), packed, 64)


# (3072, 576): SmolLM2's gate_up (I = 1536, fused); (96, 64): I = 48, half a panel (the two ops);
# (128, 1000): I = 64, K with a tail tile
GATE_UP_SHAPES = [(3072, 576), (96, 64), (128, 1000)]


@pytest.mark.parametrize(("out_features", "in_features"), GATE_UP_SHAPES,
                         ids=[f"{o}x{i}" for o, i in GATE_UP_SHAPES])
@pytest.mark.parametrize("rows", [1, 7, 17, 40, 601])
def test_gate_up_and_silu_in_one_op_give_the_two_ops_bits(out_features: int, in_features: int, rows: int,
                                                          isa_level: str) -> None:
    """gemv_bf16_silu (one pass at every level: silu(gate) * up from the tiles' or the passes' sums) against the
    projection then silu_mul: the same bits at every level, in the vector chunks and the scalar tail alike."""
    g = torch.Generator().manual_seed(rows + out_features)
    lin = LinearWeight(torch.randn(out_features, in_features, generator=g) * 0.1, weight_dtype=torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g) * 2
    fused = lin.silu_mul(x)
    assert fused.shape == (rows, out_features // 2)
    assert torch.equal(fused, torch.ops.baton_cpu.silu_mul(lin(x)))
    gate, up = lin(x).double().chunk(2, dim=-1)
    assert torch.allclose(fused.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_gate_up_and_silu_refuses_an_odd_width() -> None:
    packed = torch.ops.baton_cpu.gemv_bf16_pack(torch.randn(65, 32))
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.baton_cpu.gemv_bf16_silu(torch.randn(2, 32), packed, 65)


@pytest.mark.parametrize("rows", [1, 40])
def test_bits_do_not_depend_on_the_prefetch_distance(rows: int) -> None:
    """The amx level prefetches the weight ahead of its tile loads (gemv_bf16_prefetch sets how far, 0: not at
    all); a prefetch moves no sum, in the plain and the gate_up-with-SiLU form alike. Other levels ignore it."""
    g = torch.Generator().manual_seed(rows)
    lin = LinearWeight(torch.randn(3072, 576, generator=g) * 0.1, weight_dtype=torch.bfloat16)
    x = torch.randn(rows, 576, generator=g)
    default = torch.ops.baton_cpu.gemv_bf16_prefetch(0)
    try:
        assert default > 0
        off, off_silu = lin(x), lin.silu_mul(x)
        for distance in (64, 4096, 1 << 20):
            torch.ops.baton_cpu.gemv_bf16_prefetch(distance)
            assert torch.equal(lin(x), off) and torch.equal(lin.silu_mul(x), off_silu), distance
    finally:
        torch.ops.baton_cpu.gemv_bf16_prefetch(default)
    with pytest.raises(RuntimeError, match="whole lines"):
        torch.ops.baton_cpu.gemv_bf16_prefetch(100)


@pytest.mark.parametrize("rows", [1, 9, 32, 64, 300])
def test_bits_do_not_depend_on_the_next_panel_prefetch(rows: int, isa_level: str) -> None:
    """Below amx a decode batch's later passes prefetch the next panel (gemv_bf16_next_prefetch): no sum moves,
    plain or gate_up with its SiLU, at one pass (1 row), several, and more rows than it runs at (300)."""
    g = torch.Generator().manual_seed(rows + 1)
    lin = LinearWeight(torch.randn(3072, 576, generator=g) * 0.1, weight_dtype=torch.bfloat16)
    x = torch.randn(rows, 576, generator=g)
    toggle = torch.ops.baton_cpu.gemv_bf16_next_prefetch
    default = toggle(False)
    try:
        off, off_silu = lin(x), lin.silu_mul(x)
        toggle(True)
        assert torch.equal(lin(x), off) and torch.equal(lin.silu_mul(x), off_silu)
    finally:
        toggle(default)
    assert default is True
