"""Rejection sampling as two Triton kernels: the GPU twin of `rejection_sample_ref`.

Semantics, inputs and the accepted / recovered / bonus vocabulary are in
`rejection_sampler.py`; results are bit-identical to the reference on the same
inputs (IEEE division, first-index argmax ties, the same comparisons).

    launch 1  grid (num_seqs, max_k + 1)   one program per (row, position) <= num_draft:
              walk the vocab in tiles of BLOCK_V and keep a running argmax of
                greedy row             p_j                        -> argmax
                sampled, j < n         max(0, p_j - q_j) / e      -> recovered candidate
                sampled, j == n        p_j / e                    -> bonus candidate
              (p_j / e is tracked too, for an all-zero residual)
    launch 2  grid (num_seqs,)         one program per row: scalar loads only,
              accept drafts until the first failure, then write the candidate
              at that position and num_accepted

Computing every position's candidate in launch 1 spreads the vocab-sized work
over (num_seqs x (max_k + 1)) programs; launch 2 is tiny.

This module imports triton at module level; import it lazily (the kernels are
built when the module is imported, which is when triton decides between
compiling and interpreting).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.ops.rejection_sampler import RejectionNoise, RejectionOutput
from shared.ops.triton_attention import triton_available

__all__ = ["rejection_sample_triton", "triton_available"]

_MAX_BLOCK_V = 2048


@triton.jit
def _candidates_kernel(
    cand_ptr,  # [num_seqs, max_k + 1] int64 out
    target_ptr,  # [num_seqs, max_k + 1, vocab] float32
    draft_probs_ptr,  # [num_seqs, max_k, vocab] float32 (unused without HAS_DRAFT_PROBS)
    draft_ids_ptr,  # [num_seqs, max_k] int64
    num_draft_ptr,  # [num_seqs] int32/int64
    is_greedy_ptr,  # [num_seqs] bool
    exp_ptr,  # [num_seqs, vocab] float32
    vocab,
    stride_tr,
    stride_tp,
    stride_dr,
    stride_dp,
    stride_ir,
    stride_er,
    stride_cr,
    MAX_K: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Candidate token of one (row, position): the argmax of the score that position would sample from."""
    row = tl.program_id(0)
    pos = tl.program_id(1)
    num_draft = tl.minimum(tl.load(num_draft_ptr + row).to(tl.int32), MAX_K)
    if pos > num_draft:
        return
    greedy_flag = tl.load(is_greedy_ptr + row)
    greedy = greedy_flag != 0
    sampled_row = greedy_flag == 0
    residual_pos = (pos < num_draft) & sampled_row
    row64 = row.to(tl.int64)
    target_row = target_ptr + row64 * stride_tr + pos * stride_tp
    draft_row = draft_probs_ptr + row64 * stride_dr + pos * stride_dp
    draft_id = tl.load(draft_ids_ptr + row64 * stride_ir + pos, mask=residual_pos, other=-1)
    offs = tl.arange(0, BLOCK_V)
    # row-level conditions folded into index bounds: a limit of 0 masks a whole load
    # (also sidesteps the interpreter, which mis-types vector & scalar masks)
    q_limit = tl.where(residual_pos, vocab, 0)
    e_limit = tl.where(sampled_row, vocab, 0)

    best_res = tl.full([], float("-inf"), tl.float32)  # best residual (greedy: target) score
    arg_res = tl.full([], 0, tl.int32)
    best_tgt = tl.full([], float("-inf"), tl.float32)  # best target score, the fallback
    arg_tgt = tl.full([], 0, tl.int32)
    max_residual = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        in_vocab = idx < vocab
        p = tl.load(target_row + idx, mask=in_vocab, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_row + idx, mask=idx < q_limit, other=0.0)
        else:
            q = (idx == draft_id).to(tl.float32)
        e = tl.load(exp_ptr + row64 * stride_er + idx, mask=idx < e_limit, other=1.0)
        residual = tl.where(residual_pos, tl.maximum(p - q, 0.0), p)
        max_residual = tl.maximum(max_residual, tl.max(tl.where(in_vocab, residual, 0.0), axis=0))
        s_res = tl.where(in_vocab, tl.where(greedy, p, tl.div_rn(residual, e)), float("-inf"))
        s_tgt = tl.where(in_vocab, tl.where(greedy, p, tl.div_rn(p, e)), float("-inf"))
        # strict > keeps the earliest tile on ties; tl.argmax keeps the earliest index in a tile
        tile_res = tl.max(s_res, axis=0)
        better = tile_res > best_res
        arg_res = tl.where(better, start + tl.argmax(s_res, axis=0).to(tl.int32), arg_res)
        best_res = tl.where(better, tile_res, best_res)
        tile_tgt = tl.max(s_tgt, axis=0)
        better = tile_tgt > best_tgt
        arg_tgt = tl.where(better, start + tl.argmax(s_tgt, axis=0).to(tl.int32), arg_tgt)
        best_tgt = tl.where(better, tile_tgt, best_tgt)

    use_residual = greedy | (residual_pos == 0) | (max_residual > 0.0)
    token = tl.where(use_residual, arg_res, arg_tgt)
    tl.store(cand_ptr + row64 * stride_cr + pos, token.to(tl.int64))


@triton.jit
def _accept_kernel(
    out_ptr,  # [num_seqs, max_k + 1] int64, prefilled with -1
    num_accepted_ptr,  # [num_seqs] int64 out
    cand_ptr,  # [num_seqs, max_k + 1] int64
    target_ptr,  # [num_seqs, max_k + 1, vocab] float32
    draft_probs_ptr,  # [num_seqs, max_k, vocab] float32 (unused without HAS_DRAFT_PROBS)
    draft_ids_ptr,  # [num_seqs, max_k] int64
    num_draft_ptr,  # [num_seqs] int32/int64
    is_greedy_ptr,  # [num_seqs] bool
    uniform_ptr,  # [num_seqs, >= max_k] float32
    vocab,
    stride_tr,
    stride_tp,
    stride_dr,
    stride_dp,
    stride_ir,
    stride_ur,
    stride_cr,
    stride_or,
    MAX_K: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
):
    """Walk one row's drafts: accept until the first failure, then emit that position's candidate."""
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    num_draft = tl.minimum(tl.load(num_draft_ptr + row).to(tl.int32), MAX_K)
    greedy_flag = tl.load(is_greedy_ptr + row)
    greedy = greedy_flag != 0
    sampled_row = greedy_flag == 0
    num_accepted = tl.full([], 0, tl.int32)
    rejected = tl.full([], 0, tl.int32)
    for pos in range(0, num_draft):
        active = rejected == 0
        draft_id = tl.load(draft_ids_ptr + row64 * stride_ir + pos, mask=active, other=-1)
        in_vocab = (draft_id >= 0) & (draft_id < vocab)
        sampled = active & in_vocab & sampled_row
        p = tl.load(target_ptr + row64 * stride_tr + pos * stride_tp + draft_id, mask=sampled, other=0.0)
        if HAS_DRAFT_PROBS:
            q_ptr = draft_probs_ptr + row64 * stride_dr + pos * stride_dp + draft_id
            q = tl.load(q_ptr, mask=sampled, other=1.0)
        else:
            q = 1.0
        u = tl.load(uniform_ptr + row64 * stride_ur + pos, mask=active & sampled_row, other=1.0)
        cand = tl.load(cand_ptr + row64 * stride_cr + pos, mask=active, other=-1)
        ok = tl.where(greedy, draft_id == cand, u * q < p) & in_vocab & active
        tl.store(out_ptr + row64 * stride_or + pos, draft_id, mask=ok)
        num_accepted += ok.to(tl.int32)
        rejected = tl.where(active & (ok == 0), 1, rejected)
    token = tl.load(cand_ptr + row64 * stride_cr + num_accepted)
    tl.store(out_ptr + row64 * stride_or + num_accepted, token)
    tl.store(num_accepted_ptr + row, num_accepted.to(tl.int64))


def _check_inputs(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k]
    num_draft_tokens: torch.Tensor,  # [num_seqs]
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab]
    draft_probs: torch.Tensor | None,  # [num_seqs, max_k, vocab]
    is_greedy: torch.Tensor,  # [num_seqs]
    noise: RejectionNoise,
) -> None:
    """Fail loudly on anything the kernels would silently misread."""
    assert draft_token_ids.dim() == 2, draft_token_ids.shape
    num_seqs, max_k = draft_token_ids.shape
    assert target_probs.dim() == 3 and target_probs.shape[:2] == (num_seqs, max_k + 1), (
        f"target_probs {tuple(target_probs.shape)} for draft_token_ids {tuple(draft_token_ids.shape)}"
    )
    vocab = target_probs.shape[2]
    assert draft_token_ids.dtype == torch.int64, f"draft_token_ids must be int64, got {draft_token_ids.dtype}"
    assert num_draft_tokens.dtype in (torch.int32, torch.int64), num_draft_tokens.dtype
    assert num_draft_tokens.shape == (num_seqs,), num_draft_tokens.shape
    assert is_greedy.dtype == torch.bool, f"is_greedy must be bool, got {is_greedy.dtype}"
    assert is_greedy.shape == (num_seqs,), is_greedy.shape
    assert target_probs.dtype == torch.float32, f"target_probs must be float32, got {target_probs.dtype}"
    assert noise.uniform.dtype == noise.exponential.dtype == torch.float32
    assert noise.uniform.dim() == 2 and noise.uniform.shape[0] == num_seqs, noise.uniform.shape
    assert noise.uniform.shape[1] >= max_k, f"uniform {tuple(noise.uniform.shape)} < max_k {max_k}"
    assert noise.exponential.shape == (num_seqs, vocab), noise.exponential.shape
    tensors = {
        "draft_token_ids": draft_token_ids,
        "target_probs": target_probs,
        "uniform": noise.uniform,
        "exponential": noise.exponential,
    }
    if draft_probs is not None:
        assert draft_probs.shape == (num_seqs, max_k, vocab), (draft_probs.shape, (num_seqs, max_k, vocab))
        assert draft_probs.dtype == torch.float32, f"draft_probs must be float32, got {draft_probs.dtype}"
        tensors["draft_probs"] = draft_probs
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name} last dim must be contiguous, strides {t.stride()}"
        assert t.device == target_probs.device, f"{name} on {t.device}, target_probs on {target_probs.device}"
    for name, t in (("num_draft_tokens", num_draft_tokens), ("is_greedy", is_greedy)):
        assert t.is_contiguous(), f"{name} must be contiguous"
        assert t.device == target_probs.device, f"{name} on {t.device}, target_probs on {target_probs.device}"


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k] int64, padded past num_draft_tokens
    num_draft_tokens: torch.Tensor,  # [num_seqs] int32/int64, each in [0, max_k]
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab] float32, processed
    draft_probs: torch.Tensor | None,  # [num_seqs, max_k, vocab] float32; None = one-hot drafts
    is_greedy: torch.Tensor,  # [num_seqs] bool
    noise: RejectionNoise,
    *,
    block_v: int | None = None,
) -> RejectionOutput:
    """Same contract and results as `rejection_sample_ref`; `block_v` overrides the vocab tile (tests)."""
    _check_inputs(draft_token_ids, num_draft_tokens, target_probs, draft_probs, is_greedy, noise)
    num_seqs, max_k = draft_token_ids.shape
    vocab = target_probs.shape[2]
    device = target_probs.device
    token_ids = torch.full((num_seqs, max_k + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    if num_seqs == 0:
        return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)
    candidates = torch.empty(num_seqs, max_k + 1, dtype=torch.int64, device=device)
    has_draft_probs = draft_probs is not None
    # without draft probs the kernels never read the pointer; any float32 tensor stands in
    dp = draft_probs if draft_probs is not None else target_probs
    block_v = block_v or min(triton.next_power_of_2(vocab), _MAX_BLOCK_V)
    assert block_v & (block_v - 1) == 0, f"block_v {block_v} must be a power of 2"
    _candidates_kernel[(num_seqs, max_k + 1)](
        candidates, target_probs, dp, draft_token_ids, num_draft_tokens, is_greedy, noise.exponential,
        vocab,
        target_probs.stride(0), target_probs.stride(1), dp.stride(0), dp.stride(1),
        draft_token_ids.stride(0), noise.exponential.stride(0), candidates.stride(0),
        MAX_K=max_k, HAS_DRAFT_PROBS=has_draft_probs, BLOCK_V=block_v,
        num_warps=4,
    )  # fmt: skip
    _accept_kernel[(num_seqs,)](
        token_ids, num_accepted, candidates, target_probs, dp, draft_token_ids, num_draft_tokens,
        is_greedy, noise.uniform,
        vocab,
        target_probs.stride(0), target_probs.stride(1), dp.stride(0), dp.stride(1),
        draft_token_ids.stride(0), noise.uniform.stride(0), candidates.stride(0), token_ids.stride(0),
        MAX_K=max_k, HAS_DRAFT_PROBS=has_draft_probs,
        num_warps=1,
    )  # fmt: skip
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)
