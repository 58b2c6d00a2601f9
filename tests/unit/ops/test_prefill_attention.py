"""The CPU's causal prompt-chunk attention (csrc/prefill_attention_cpu.cpp) against SDPA with the chunk's mask:
head groups, head dims from 8 to 512, earlier context, sliding windows, a bf16 cache's keys, strided views,
threads, every instruction-set level the machine runs; bad shapes are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.ops import cpu_isa
from shared.ops.cpu_kernels import cpu_kernels_available
from tests.helpers.torch_threads import torch_threads
from tests.unit.ops.conftest import fp8_subnormals_zeroed


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    kk = k.float().repeat_interleave(h // hkv, 1).transpose(0, 1)
    vv = v.float().repeat_interleave(h // hkv, 1).transpose(0, 1)
    pos = torch.arange(lk - lq, lk)[:, None]
    key_pos = torch.arange(lk)[None]
    mask = key_pos <= pos
    if window:
        mask &= key_pos > pos - window
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale).transpose(0, 1)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    out = torch.empty_like(q)
    torch.ops.baton_cpu.prefill_attention(out, q, k, v, scale, window)
    return out


CASES = [  # (query tokens, context + query tokens, heads, KV heads, head dim, window)
    (256, 256, 9, 3, 64, 0),  # SmolLM2, a fresh chunk
    (37, 100, 8, 2, 128, 0),  # a later chunk with context, a partial last tile
    (50, 50, 4, 4, 256, 16),  # Gemma's sliding layers
    (40, 90, 8, 2, 256, 24),  # a window with context before the chunk
    (5, 300, 16, 2, 512, 0),  # Gemma 4's global head dim
    (19, 19, 6, 2, 12, 0),  # a head dim no vector width divides
    (17, 33, 2, 1, 8, 3),
    (1, 1, 2, 1, 16, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["fp32-kv", "bf16-kv", "e4m3-kv", "e5m2-kv"])
@pytest.mark.parametrize(("lq", "lk", "heads", "kv_heads", "head_dim", "window"), CASES,
                         ids=[f"{c[0]}of{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-w{c[5]}" for c in CASES])
def test_matches_sdpa_with_the_chunks_mask(lq: int, lk: int, heads: int, kv_heads: int, head_dim: int, window: int,
                                           dtype: torch.dtype, isa_level: str) -> None:
    """From avx512_bf16 up a bf16 or fp8 cache with head dims of a multiple of 32 takes vdpbf16ps passes
    (csrc/bf16_pairs.h), which read fp8 subnormals as zero and round the query and the softmax weights to bf16:
    there the cache holds no subnormal, the query is one bf16 holds exactly, and the outputs may differ by the
    weights' rounding, at most 2^-9 of the largest value (allowed: 2^-8)."""
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(lq * 1000 + lk)
    q = torch.randn(lq, heads, head_dim, generator=g)
    k = torch.randn(lk, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(lk, kv_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    atol = 2e-6
    if cpu_isa.isa_at_least("avx512_bf16") and dtype != torch.float32 and head_dim % 32 == 0:
        q, k, v = q.bfloat16().float(), fp8_subnormals_zeroed(k), fp8_subnormals_zeroed(v)
        atol = 2**-8 * v.float().abs().max().item()
    torch.testing.assert_close(_run(q, k, v, scale, window), _reference(q, k, v, scale, window), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_strided_views_and_threads(threads: int) -> None:
    """Slices of a step's packed tensors (the engine passes query[lo:hi], a gathered cache's keys) and any thread
    count give the same numbers: every output row is one job's, whatever thread runs it."""
    g = torch.Generator().manual_seed(7)
    packed_q = torch.randn(300, 9, 64, generator=g)
    kv = torch.randn(2, 200, 3, 64, generator=g)  # keys and values interleaved: strided views
    q, k, v = packed_q[40:140], kv[0, 100:200], kv[1, 100:200]
    out = torch.full((300, 9, 64), float("nan"))
    with torch_threads(threads):
        torch.ops.baton_cpu.prefill_attention(out[40:140], q, k, v, 0.125, 0)
    torch.testing.assert_close(out[40:140], _reference(q, k, v, 0.125, 0), atol=2e-6, rtol=1e-5)
    assert out[:40].isnan().all() and out[140:].isnan().all()  # nothing outside its rows written
    with torch_threads(1):
        one = _run(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, 0)
    assert torch.equal(one, out[40:140])


def test_bad_shapes_are_refused() -> None:
    q = torch.randn(8, 4, 16)
    k = torch.randn(8, 2, 16)
    op = torch.ops.baton_cpu.prefill_attention
    with pytest.raises(RuntimeError, match="lengths"):
        op(torch.empty_like(q), q, k[:4], k[:4], 1.0, 0)  # fewer keys than queries
    with pytest.raises(RuntimeError, match="head groups"):
        op(torch.empty_like(q), q, torch.randn(8, 3, 16), torch.randn(8, 3, 16), 1.0, 0)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.empty_like(q), q, k.half(), k.half(), 1.0, 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.empty_like(q), q, k.transpose(1, 2).contiguous().transpose(1, 2), k, 1.0, 0)
