"""Paged attention as one Triton kernel: the GPU twin of `paged_attention_ref`.

One launch covers a mixed batch (prefill chunks, fresh prefills, decode tokens).
Each program owns one *query block* of one sequence and one KV head: up to
`BLOCK_Q` consecutive query tokens times the `GROUP` query heads that share the
KV head, folded into `BLOCK_M = BLOCK_Q * GROUP` (padded) rows. Folding the
group in means a decode token still fills a tensor-core tile, and each K/V tile
is read once per group instead of once per query head.

The program walks the sequence's keys in tiles of `BLOCK_N` positions, looking
each position's block up in the block table (so `BLOCK_N` is independent of the
cache's `block_size`), and keeps an online softmax in fp32. Tiles that lie
wholly before the sliding window or after the last query position are never
visited.

This module imports triton at module level; import it lazily (the kernel is
built when the module is imported, which is when triton decides between
compiling and interpreting).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.ops.attention import AttentionMetadata, paged_attention_ref

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# tl.dot needs every dimension >= 16 on GPUs.
_MIN_DOT = 16


def triton_available() -> bool:
    """True when the kernel can run here: triton imports and either CUDA or the interpreter is on."""
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret) or torch.cuda.is_available()


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,
    target_block,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """Index of the sequence owning global query block `target_block`.

    Sequence i's blocks start at `query_start_loc[i] // BLOCK_Q + i`, which is
    strictly increasing in i, so a binary search finds the last start <= target.
    """
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= target_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _dot(a, b, IEEE_FP32: tl.constexpr):
    """a @ b accumulated in fp32; fp32 inputs skip TF32 so results match the fp32 reference."""
    if IEEE_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_kv_tile(
    k_head,  # k_cache base already offset to this program's KV head
    v_head,  # v_cache base already offset to this program's KV head
    table_row,  # this sequence's block-table row
    start_n,
    seq_len,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    offs_n,  # [BLOCK_N]
    offs_d,  # [HEAD_DIM_PAD]
    d_mask,  # [HEAD_DIM_PAD]
    BLOCK_SIZE: tl.constexpr,
):
    """K^T [HEAD_DIM_PAD, BLOCK_N] and V [BLOCK_N, HEAD_DIM_PAD] for key positions start_n + offs_n.

    Each position finds its physical block through the table; positions at or past
    `seq_len` load zeros (their slots may hold anything, and the table is padded).
    """
    k_pos = start_n + offs_n  # [BLOCK_N]
    k_valid = k_pos < seq_len
    block_id = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    slot_off = (k_pos % BLOCK_SIZE).to(tl.int64)
    k = tl.load(
        k_head + block_id[None, :] * stride_kb + slot_off[None, :] * stride_kt + offs_d[:, None],
        mask=k_valid[None, :] & d_mask[:, None],
        other=0.0,
    )
    v = tl.load(
        v_head + block_id[:, None] * stride_vb + slot_off[:, None] * stride_vt + offs_d[None, :],
        mask=k_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    return k, v, k_pos, k_valid


@triton.jit
def _online_softmax_step(
    s,  # [BLOCK_M, BLOCK_N] fp32 scaled scores, -inf where masked
    v,  # [BLOCK_N, HEAD_DIM_PAD]
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32 unnormalised output so far
    l_i,  # [BLOCK_M] fp32 running softmax denominator
    m_i,  # [BLOCK_M] fp32 running row max
    IEEE_FP32: tl.constexpr,
):
    """Fold one tile into the running (acc, l, m) of the online softmax."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet (padding, or a tile before its window) keeps
    # m = -inf; shifting by 0 instead avoids exp(-inf - -inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_FP32)
    return acc, l_i, m_new


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale,
    num_seqs,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """One (query block, KV head): BLOCK_Q tokens x GROUP heads as rows, online softmax over key tiles."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    # The grid is an upper bound on the number of query blocks; spares exit here.
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    q_local = local_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query index inside the sequence
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    # Rows past BLOCK_Q * GROUP would alias the next block's first token when GROUP
    # does not divide BLOCK_M; they are padding, like rows past the sequence's end.
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = context_len + q_local  # [BLOCK_M] absolute position of each row's token
    tok = (q_start + q_local).to(tl.int64)

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    # Key range this block can see: up to its last token's position, and from its
    # first token's window start on sliding-window layers.
    last_pos = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(context_len + local_block * BLOCK_Q - sliding_window + 1, 0)
    tile_lo = (first_key // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    for start_n in range(tile_lo, last_pos + 1, BLOCK_N):
        k, v, k_pos, k_valid = _load_kv_tile(
            k_head, v_head, table_row, start_n, seq_len,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, d_mask, BLOCK_SIZE,
        )  # fmt: skip
        s = _dot(q, k, IEEE_FP32) * scale  # [BLOCK_M, BLOCK_N] fp32
        allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        acc, l_i, m_i = _online_softmax_step(s, v, acc, l_i, m_i, IEEE_FP32)

    # Every real row sees at least its own position, so l_i > 0 where we store.
    out = acc / tl.where(row_mask, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _check_inputs(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> None:
    """Fail loudly on anything the kernel would silently misread."""
    assert query.dim() == 3 and k_cache.dim() == 4, (query.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    assert k_cache.shape[3] == head_dim, (k_cache.shape, head_dim)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim & (head_dim - 1) == 0 and head_dim <= 256, f"head_dim {head_dim}"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size}"  # keys are gathered token by token
    assert query.dtype in _SUPPORTED_DTYPES, query.dtype
    assert k_cache.dtype == v_cache.dtype == query.dtype, (query.dtype, k_cache.dtype, v_cache.dtype)
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name} last dim must be contiguous, strides {t.stride()}"
    for name, t in (
        ("query_start_loc", meta.query_start_loc),
        ("seq_lens", meta.seq_lens),
        ("block_tables", meta.block_tables),
    ):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
        assert t.device == query.device, f"{name} on {t.device}, query on {query.device}"
    assert k_cache.device == v_cache.device == query.device, (query.device, k_cache.device)
    assert meta.query_start_loc.shape == (meta.num_seqs + 1,), meta.query_start_loc.shape
    assert meta.seq_lens.shape == (meta.num_seqs,), meta.seq_lens.shape
    assert meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == meta.num_seqs
    assert meta.block_tables.stride(1) == 1, meta.block_tables.stride()
    assert meta.query_start_loc.is_contiguous() and meta.seq_lens.is_contiguous()


@dataclass(frozen=True)
class DecodeTiling:
    """Decode-only launches: keys a tile (None: by head size, as prefill), warps and pipeline stages a program."""

    block_n: int | None = None
    num_warps: int = 4
    num_stages: int | None = None  # None: triton's default


def _measured_decode_tiling(head_dim: int) -> DecodeTiling:
    """Heads of 64 walk the context in tiles of 256 keys, one stage: on an H200 at batch 1, 4.4 us against 6.1
    at 192 keys and 13.4 against 22.6 at 1024 (attention_tune-20261127-191301.json, the fastest of 16 tilings
    at both lengths). Wider heads keep the prefill tiles (not measured; their tiles would not fit registers)."""
    return DecodeTiling(256, 4, 1) if head_dim <= 64 else DecodeTiling()


_decode_tiling: DecodeTiling | None = None  # None: _measured_decode_tiling


def use_decode_tiling(tiling: DecodeTiling | None) -> DecodeTiling | None:
    """Launch decode-only steps with `tiling` (None: the measured rule); returns the one it replaces.
    bench/attention_tune.py times a grid of tilings with it."""
    global _decode_tiling
    old, _decode_tiling = _decode_tiling, tiling
    return old


def _block_shape(head_dim: int, group: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N) for one launch.

    Decode-only batches use the smallest row tile that holds a query group; prefill
    takes more tokens per program so each K/V tile is reused across them. Wide
    heads get smaller tiles to keep the fp32 accumulator in registers.
    """
    want = _MIN_DOT if max_query_len <= 1 else (64 if head_dim <= 128 else 32)
    block_m = max(want, triton.next_power_of_2(group))
    block_n = 64 if head_dim <= 64 else 32
    return block_m, block_m // group, block_n


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] unused: already in the cache
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] unused: already in the cache
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged attention over mixed prefill and decode sequences; same contract as the reference.

    `key`/`value` are accepted only so this and `paged_attention_ref` are
    interchangeable: the kernel reads every key, this step's included, from the cache.
    """
    if meta.tree_masks or meta.bidirectional_spans:  # trees, images seen both ways: the kernel is causal only
        return paged_attention_ref(query, key, value, k_cache, v_cache, meta, scale, sliding_window)
    del key, value
    _check_inputs(query, k_cache, v_cache, meta)
    assert sliding_window is None or sliding_window > 0, sliding_window
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    out = torch.empty_like(query)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q, block_n = _block_shape(head_dim, group, meta.max_query_len)
    tiling = (_decode_tiling or _measured_decode_tiling(head_dim)) if meta.max_query_len <= 1 else DecodeTiling()
    extra = {"num_stages": tiling.num_stages} if tiling.num_stages is not None else {}
    # Upper bound on query blocks over all sequences, known without a device sync.
    grid = (num_tokens // block_q + meta.num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        meta.num_seqs,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        meta.block_tables.stride(0),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(head_dim, _MIN_DOT),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=tiling.block_n or block_n,
        HAS_WINDOW=sliding_window is not None,
        IEEE_FP32=query.dtype == torch.float32,
        num_warps=tiling.num_warps,
        **extra,
    )
    return out
