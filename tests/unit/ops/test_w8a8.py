"""The W8A8 GEMM (`csrc/w8a8_cpu.cpp`): int8-per-channel weights times rows quantized per block of 32,
against `shared/ops/w8a8.py: w8a8_ref` (the same integer sums, the same fold) at every instruction-set level
this CPU runs, the same bits at every level, and the same numbers qgemv computed for these weights before."""

from __future__ import annotations

import pytest
import torch

from shared.ops import cpu_isa
from shared.ops.linear import LinearWeight
from shared.ops.quant import QuantCodes, int8_per_channel, qgemv_ref
from shared.ops.w8a8 import pack, w8a8_ref
from tests.helpers.torch_threads import torch_threads

# SmolLM2's projection shapes (qkv, gate_up, down), an LM-head slice, a padded panel, one block
SHAPES = [(960, 576), (3072, 576), (576, 1536), (4096, 576), (70, 64), (5, 32)]


def _weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, QuantCodes]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    return w, int8_per_channel(w)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The reference folds in float64 rounded to fp32 a step: a last-bit difference at most, per step."""
    tol = 1e-6 * ref.abs().max().item()
    assert (got - ref).abs().max().item() <= tol


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_matches_the_reference_at_every_row_count(out_features: int, in_features: int, isa_level: str) -> None:
    w, codes = _weight(out_features, in_features, out_features + in_features)
    x = torch.randn(40, in_features, generator=torch.Generator().manual_seed(1))
    x[3] = 0.0  # a zero row: scale 0, no division by it
    lin = LinearWeight.quantized(codes)
    assert lin.backend == "w8a8" and lin.weight.dtype == torch.int8
    batched = lin(x)
    _close(batched, w8a8_ref(x, codes))
    assert torch.equal(batched[3], torch.zeros(out_features))
    for rows in (1, 2, 3, 5, 6, 7, 13, 17):  # batch invariance: a row's bits do not depend on the others
        assert torch.equal(lin(x[:rows]), batched[:rows]), rows


@pytest.mark.parametrize("rows", [1, 15, 16, 23, 32, 50])
def test_every_level_gives_the_same_bits(rows: int) -> None:
    """Every level's integer sums are exact and fold alike (amx: the tiles from 16 rows, VNNI below)."""
    w, codes = _weight(600, 1536, 2)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(3))
    with cpu_isa.use_isa("portable"):
        portable = lin(x)
    for level in ("avx2", "avx512", "avx512_bf16", "amx"):
        if cpu_isa.isa_supported(level):
            with cpu_isa.use_isa(level):
                assert torch.equal(lin(x), portable), level


def test_the_numbers_qgemv_served_for_int8() -> None:
    """The same quantized rows and weights as qgemv (llama.cpp's Q8_0 x Q8_0): only the fp32 order differs."""
    w, codes = _weight(960, 576, 4)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(5))
    ref = qgemv_ref(x, codes)
    assert (LinearWeight.quantized(codes)(x) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_a_prompt_chunk_of_rows_spans_several_row_blocks(isa_level: str) -> None:
    """More rows than one L2 block (256 KiB of u8 rows: 455 rows of 576) take the blocked loop."""
    w, codes = _weight(96, 576, 7)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(1000, 576, generator=torch.Generator().manual_seed(8))
    batched = lin(x)
    _close(batched, w8a8_ref(x, codes))
    assert torch.equal(lin(x[500:505]), batched[500:505])


@pytest.mark.parametrize("threads", [1, 3])
def test_bits_do_not_depend_on_threads(threads: int) -> None:
    w, codes = _weight(3072, 576, 5)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(6))
    with torch_threads(2):
        two = lin(x)
    with torch_threads(threads):
        assert torch.equal(lin(x), two)


@pytest.mark.parametrize("rows", [1, 7, 16, 32, 64, 300])
def test_the_next_panel_prefetch_changes_no_bit(rows: int, isa_level: str) -> None:
    """A decode batch's later passes prefetch the next panel (w8a8_next_prefetch): the same sums either way,
    at one pass (1 row), several, and more rows than stream (300)."""
    w, codes = _weight(3072, 576, 9)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(10))
    toggle = torch.ops.baton_cpu.w8a8_next_prefetch
    default = toggle(False)
    try:
        off = lin(x)
        toggle(True)
        on = lin(x)
    finally:
        toggle(default)
    assert default is True
    assert torch.equal(on, off)
    _close(on, w8a8_ref(x, codes))


# gate_up shapes: SmolLM2's (two panels of gate a step: 1536 of 576), one panel each, and gate and up not whole
# panels (the two ops)
GATE_UP = [(3072, 576), (64, 96), (2 * 40, 64)]


@pytest.mark.parametrize(("out_features", "in_features"), GATE_UP, ids=[f"{o}x{i}" for o, i in GATE_UP])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 32, 300, 1000])
def test_the_gated_projection_gives_silu_mul_of_the_projection(out_features: int, in_features: int, rows: int,
                                                               isa_level: str) -> None:
    """w8a8_silu runs gate_up and silu(gate) * up in one pass: silu_mul over w8a8's output, bit for bit, at
    every row count (one pass, several, streamed, row blocks) and through LinearWeight.silu_mul."""
    w, codes = _weight(out_features, in_features, 11)
    lin = LinearWeight.quantized(codes)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(12))
    expected = torch.ops.baton_cpu.silu_mul(lin(x))
    got = torch.ops.baton_cpu.w8a8_silu(x, lin.weight, out_features)
    assert got.shape == (rows, out_features // 2)
    assert torch.equal(got, expected)
    assert torch.equal(lin.silu_mul(x), expected)


def test_the_gated_projection_rejects_an_odd_width() -> None:
    w, codes = _weight(64, 64, 13)
    lin = LinearWeight.quantized(codes)
    with pytest.raises(RuntimeError, match="even number"):
        torch.ops.baton_cpu.w8a8_silu(torch.randn(2, 64), lin.weight, 63)


def test_a_byte_and_an_eighth_a_weight() -> None:
    """A code, and a block offset (int32) per 32 of them: 0.56x bf16's bytes."""
    w, codes = _weight(960, 576, 13)
    assert LinearWeight.quantized(codes).nbytes == 960 * 576 * 9 // 8 + 960 * 4


def test_int8_codes_pack_only_as_int8_per_channel() -> None:
    w, codes = _weight(64, 64, 11)
    with pytest.raises(ValueError, match="int8 per channel"):
        pack(QuantCodes(codes.codes, codes.d, codes.m, 8, "Q8_0"))
    with pytest.raises(RuntimeError, match="code 0"):
        torch.ops.baton_cpu.w8a8_pack(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.baton_cpu.w8a8_pack(torch.ones(4, 40, dtype=torch.uint8), torch.ones(4))


def test_kernel_rejects_a_mismatched_weight() -> None:
    w, codes = _weight(64, 64, 12)
    packed = pack(codes)
    with pytest.raises(RuntimeError, match="not packed by w8a8_pack"):
        torch.ops.baton_cpu.w8a8(torch.randn(2, 32), packed, 64)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        torch.ops.baton_cpu.w8a8(torch.randn(2, 64), packed, 100)
