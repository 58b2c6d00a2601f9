"""The CPU's C++ RMSNorm and RoPE against the torch references in shared.models.common.

Agreement is to fp32 rounding (the sum of squares is ordered differently); what
must be exact is that a row gives the same bits alone and inside a batch.
"""

from __future__ import annotations

import pytest
import torch

from shared.models.common import RotaryEmbedding, apply_rope, rms_norm
from shared.ops.norm_rope_cpu import add_rms_norm_cpu, apply_rope_cpu_, norm_rope_cpu_available, rms_norm_cpu

pytestmark = pytest.mark.skipif(not norm_rope_cpu_available(torch.device("cpu"), torch.float32),
                                reason="the CPU kernels did not build or are turned off")


@pytest.mark.parametrize(("rows", "d"), [(1, 576), (7, 640), (300, 576), (3, 12), (2, 5)])
def test_rms_norm_matches_reference(rows: int, d: int) -> None:
    g = torch.Generator().manual_seed(rows * d)
    x = torch.randn(rows, d, generator=g) * 3.0
    w = torch.randn(d, generator=g)
    torch.testing.assert_close(rms_norm_cpu(x, w, 1e-5), rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-5)


def test_rms_norm_rows_are_independent() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 576, generator=g)
    w = torch.randn(576, generator=g)
    batched = rms_norm_cpu(x, w, 1e-6)
    for r in (0, 17, 63):
        assert torch.equal(rms_norm_cpu(x[r:r + 1], w, 1e-6), batched[r:r + 1])


def test_rms_norm_on_strided_heads() -> None:
    """Gemma's q/k norm: [tokens, heads, head_dim] views into the fused qkv output."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 4 * 256 + 2 * 256, generator=g)
    q = qkv[:, :1024].view(5, 4, 256)
    w = torch.randn(256, generator=g)
    out = rms_norm_cpu(q, w, 1e-6)
    assert out.shape == q.shape
    torch.testing.assert_close(out, rms_norm(q, w, 1e-6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256), (2, 2, 6)])
def test_rope_matches_reference_in_place(heads: int, kv_heads: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(heads * head_dim)
    n = 11
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (n,), generator=g)
    cos_sin = RotaryEmbedding(head_dim, 10000.0, 4096, "cpu").cos_sin(positions, torch.float32)
    ref_q, ref_k = apply_rope(q.clone(), k.clone(), cos_sin)
    out_q, out_k = apply_rope_cpu_(q, k, cos_sin)
    assert out_q.data_ptr() == q.data_ptr()  # rotated where they lie
    torch.testing.assert_close(out_q, ref_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out_k, ref_k, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(qkv[:, :q_size].view(n, heads, head_dim), ref_q, atol=1e-6, rtol=1e-5)


def test_rope_rejects_mismatched_tables() -> None:
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    with pytest.raises(RuntimeError, match="cos / sin"):
        torch.ops.baton_cpu.rope_(q, k, torch.randn(2, 8), torch.randn(2, 8))


@pytest.mark.parametrize(("rows", "d"), [(1, 576), (16, 576), (300, 640), (2, 5)])
def test_add_rms_norm_equals_the_two_ops_apart(rows: int, d: int) -> None:
    """The decoder's residual add fused into the next norm: bit for bit the add, then rms_norm_cpu."""
    g = torch.Generator().manual_seed(rows + d)
    x, delta = torch.randn(rows, d, generator=g) * 4.0, torch.randn(rows, d, generator=g)
    w = torch.randn(d, generator=g)
    total, normed = add_rms_norm_cpu(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, rms_norm_cpu(x + delta, w, 1e-5))
