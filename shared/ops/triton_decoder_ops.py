"""A decoder layer's elementwise work as three Triton kernels: the GPU forms of the torch references.

A decode step on a GPU is latency-bound: SmolLM2-135M's step at batch 1 reads ~270 MB of weights (~0.1 ms of
HBM time on an H100) but, in torch ops, launches ~35 kernels a layer (~1,000 a step), and inside a CUDA graph each
costs a launch gap of its own. These three fold the ops between the projections into one launch each:

    add_rms_norm      x + delta (the previous sublayer's output) and its RMSNorm    torch: ~8 kernels
    rope_store_kv     RoPE on q and k from the qkv projection's output, k and v     torch: ~14 (rotate_half, cos/sin
                      stored at their slots in the paged cache                             gather, two index_put_)
    silu_mul          silu(gate) * up from the gate_up projection's output          torch: 3

Each keeps its reference's rounding points: a sum is rounded to the activation dtype before its statistics,
the norm's weight multiplies after the cast back (Llama) or in fp32 before it (Gemma's 1 + w), RoPE's two
products are rounded before their sum as torch's `x * cos + rotate_half(x) * sin` rounds them. The differences
left are reduction order (a norm's mean of squares) and the exp's last bit, so bf16 results agree to rounding,
not bit for bit (tests bound them).

This module imports triton at module level; import it lazily (the kernels are built when the module is
imported, which is when triton decides between compiling and interpreting).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.ops.triton_attention import triton_available

__all__ = ["add_rms_norm", "rms_norm", "rope_store_kv", "silu_mul", "triton_available"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr,
    stride_x, stride_d, stride_s, stride_o,
    n_cols, eps,
    HAS_DELTA: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual stream, rounded as torch's add
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if WEIGHT_IN_FP32:  # Gemma: (x * inv) * (1 + w) in fp32, then the cast
        y = (xf * inv * w.to(tl.float32)).to(x.dtype)
    else:  # Llama: cast back, then the weight in the activation dtype
        y = ((xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
          weight_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None and delta.dtype != x.dtype:  # torch's add promotes (bf16 projections under fp32 x)
        common = torch.promote_types(x.dtype, delta.dtype)
        x, delta = x.to(common), delta.to(common)
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous(), (x.shape, x.stride())
    rows, cols = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else x
    if delta is not None:
        assert delta.shape == x.shape and delta.stride(-1) == 1, (delta.shape, x.shape, delta.stride())
    if rows:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(rows,)](
            x, delta if delta is not None else x, weight, total, out,
            x.stride(0), (delta if delta is not None else x).stride(0), total.stride(0), out.stride(0),
            cols, eps,
            HAS_DELTA=delta is not None, WEIGHT_IN_FP32=weight_in_fp32, BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x ([n, hidden], or [n, heads, head_dim] for q/k norms; `weight_in_fp32`:
    Gemma's (1 + w), folded in at load)."""
    return _norm(x.reshape(-1, x.shape[-1]), None, weight, eps, weight_in_fp32)[1].view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 weight_in_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): a sublayer's residual add and the next norm in one pass."""
    return _norm(x, delta, weight, eps, weight_in_fp32)


@triton.jit
def _rope_store_kv_kernel(
    qkv_ptr, q_out_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_qo_t, stride_qo_h, stride_cos,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per (token, head of q or k): rotate it; a k head also stores itself and its v head."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + tok)
    row = qkv_ptr + tok * stride_qkv + head * HEAD_DIM
    x1 = tl.load(row + half)
    x2 = tl.load(row + HALF + half)
    dt = x1.dtype
    # the table is fp32; torch's cos_sin casts it to the activation dtype before the products
    c1 = tl.load(cos_ptr + pos * stride_cos + half).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + half).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_cos + half).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_cos + HALF + half).to(dt).to(tl.float32)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded to the activation dtype before the sum
    y1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
    if head < NUM_HEADS:
        out = q_out_ptr + tok * stride_qo_t + head * stride_qo_h
        tl.store(out + half, y1)
        tl.store(out + HALF + half, y2)
    else:
        slot = tl.load(slot_ptr + tok)
        if slot >= 0:
            kv_head = head - NUM_HEADS
            block = slot // BLOCK_SIZE
            offset = slot - block * BLOCK_SIZE
            k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_o + kv_head * stride_kc_h
            kt = k_cache_ptr.dtype.element_ty
            tl.store(k_dst + half, y1.to(kt))
            tl.store(k_dst + HALF + half, y2.to(kt))
            v_src = qkv_ptr + tok * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
            v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_o + kv_head * stride_vc_h
            full = tl.arange(0, HEAD_DIM)
            tl.store(v_dst + full, tl.load(v_src + full).to(v_cache_ptr.dtype.element_ty))


def rope_store_kv(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: the qkv projection's output
    positions: torch.Tensor,  # [num_tokens] int64
    cos: torch.Tensor,  # [max_positions, head_dim] fp32 (RotaryEmbedding.cos)
    sin: torch.Tensor,  # [max_positions, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (a view of one layer's keys)
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 stores nothing
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: the rotated queries
    """RoPE on the queries and keys of a step, and its keys and values stored at their slots, in one launch."""
    num_tokens, width = qkv.shape
    head_dim = k_cache.shape[-1]
    assert width == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(-1) == 1, (qkv.shape, head_dim)
    assert head_dim % 2 == 0 and (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _rope_store_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, q, cos, sin, positions, slot_mapping, k_cache, v_cache,
            qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
            num_warps=1,
        )
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu, rounded to the activation dtype
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 * I] -> [n, I]
    """silu(gate) * up of the gate_up projection's output."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0, gate_up.shape
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(cols))
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, gate_up.stride(0), out.stride(0), cols,
                                                           BLOCK=block, num_warps=4)
    return out
