"""Routed experts with a gelu-tanh gate as two Triton grouped GEMMs over the (token, expert) pairs sorted by expert.

The GPU path of Gemma 4's experts; its reference is the torch loop
(`shared.models.gemma4.moe.TorchExperts`): same routing, same math, sums in
another order (fp32 inputs: IEEE dots, no TF32). The layout follows the grouped
GEMM that vLLM's and SGLang's fused_moe use::

    pairs p = t * top_k + j  (P = n * top_k), expert e(p) = index[t, j]
    align      pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M with the
               sentinel P, so every BLOCK_M rows of `sorted_pairs` belong to one expert (`block_expert`)
    launch 1   grid (row blocks, I / BLOCK_N): rows h[p // top_k] against gate_up[e] rows n (gate) and
               I + n (up) in one pass over K = hidden; act[p, n] = gelu_tanh(gate) * up   [P, I] fp32
    launch 2   grid (row blocks, H / BLOCK_N): rows act[p] against down[e]; y[p] = weights[p] * (...)
    out[t] = sum_j y[t * top_k + j]                                                          [n, H]

Each weight tile is loaded once per row block of its expert, so a decode step reads every expert it hits once
(the experts' bytes are the step's cost), and a prefill's rows of one expert share each tile. The alignment
runs on the device with no host sync: the grid is sized for the most row blocks any routing can need
(`P + min(E, P) * (BLOCK_M - 1)` rows), and programs past the real count return at once.

This module imports triton at module level; import it lazily (the kernels are
built when the module is imported, which is when triton decides between
compiling and interpreting).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.ops.triton_attention import triton_available

__all__ = ["align_by_expert", "fused_moe_triton", "triton_available"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ExpertAlignment:
    sorted_pairs: torch.Tensor  # [max_rows] int32: pair ids by expert, runs padded with num_pairs
    block_expert: torch.Tensor  # [max_rows / block_m] int32: the expert of each block of rows
    num_rows: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def align_by_expert(index: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:  # [n, top_k] int
    """The pairs grouped by expert in blocks of `block_m` rows of one expert each (see the module docstring)."""
    flat = index.reshape(-1).long()
    num_pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs by expert, tokens in order within one
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    max_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[(padded_end - padded)[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertAlignment(sorted_pairs, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32), block_m)


@triton.jit
def _gelu_tanh(x):
    # tanh(z) = 2 sigmoid(2z) - 1
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 * tl.sigmoid(2.0 * z))


@triton.jit
def _dot(a, b, IEEE_FP32: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32; fp32 inputs skip TF32 so results match the fp32 reference. UPCAST: 16-bit
    inputs multiplied in fp32 (Triton's interpreter gets 16-bit dots wrong; the compiled kernel never sets it)."""
    if IEEE_FP32:
        return tl.dot(a, b, input_precision="ieee")
    elif UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of a, K]: h (launch 1: pair p reads row p // top_k) or act (launch 2: row p)
    w_ptr,  # [E, N (x2 when GATED: gate rows, then up rows), K] contiguous
    c_ptr,  # [P, N] fp32 out, row p
    weights_ptr,  # [P] fp32 routing weights (read when MUL_WEIGHT)
    sorted_pairs_ptr,  # [max_rows] int32
    block_expert_ptr,  # [max_blocks] int32
    num_rows_ptr,  # [1] int32
    N,
    K,
    num_pairs,
    pairs_per_a_row,
    stride_am,
    stride_we,
    stride_cm,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs
    a_rows = tl.where(valid, pairs // pairs_per_a_row, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        # [BLOCK_K, BLOCK_N]: column n of the tile is weight row n
        w = tl.load(w_base + offs_n[None, :].to(tl.int64) * K + offs_k[:, None], mask=w_mask, other=0.0)
        acc = acc + _dot(a.to(w.dtype), w, IEEE_FP32, UPCAST)
        if GATED:
            w_up = tl.load(w_base + (N + offs_n[None, :]).to(tl.int64) * K + offs_k[:, None], mask=w_mask,
                           other=0.0)
            acc_up = acc_up + _dot(a.to(w_up.dtype), w_up, IEEE_FP32, UPCAST)
    if GATED:
        acc = _gelu_tanh(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_rows = tl.where(valid, pairs, 0).to(tl.int64)
    tl.store(c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :], acc, mask=valid[:, None] & n_ok[None, :])


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) while experts get a few rows each (decode), more for prefill."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, al: ExpertAlignment,
            pairs_per_a_row: int, gated: bool) -> None:
    n_out = out.shape[1]
    block_n, block_k = 64, 64 if w.shape[2] >= 64 else 32
    grid = (al.max_blocks, triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, weights, al.sorted_pairs, al.block_expert, al.num_rows,
        n_out, w.shape[2], weights.numel(), pairs_per_a_row,
        a.stride(0), w.stride(0), out.stride(0),
        GATED=gated, MUL_WEIGHT=not gated, IEEE_FP32=w.dtype == torch.float32, UPCAST=_interpreting(),
        BLOCK_M=al.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def fused_moe_triton(
    h: torch.Tensor,  # [n, hidden]
    weights: torch.Tensor,  # [n, top_k] routing weights
    index: torch.Tensor,  # [n, top_k] expert ids
    gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor,  # [num_experts, hidden, intermediate]
) -> torch.Tensor:  # [n, hidden], h's dtype
    """sum_j weights[t, j] * down_e(gelu_tanh(gate_e(h[t])) * up_e(h[t])), e = index[t, j], per token t."""
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    assert h.dim() == 2 and h.shape[1] == hidden and h.is_contiguous(), f"h {tuple(h.shape)} vs hidden {hidden}"
    assert index.shape == weights.shape and index.shape[0] == h.shape[0], "index, weights: [n, top_k] each"
    assert down.shape == (num_experts, hidden, inter) and gate_up.is_contiguous() and down.is_contiguous()
    assert gate_up.dtype == down.dtype and gate_up.dtype in _SUPPORTED_DTYPES, f"weights {gate_up.dtype}"
    assert h.device == gate_up.device == index.device, "h, index and the weights on one device"
    n, top_k = index.shape
    if n == 0:
        return torch.zeros_like(h)
    num_pairs = n * top_k
    al = align_by_expert(index, num_experts, _block_m(num_pairs, num_experts))
    flat_weights = weights.reshape(-1).float().contiguous()
    act = torch.empty(num_pairs, inter, dtype=torch.float32, device=h.device)
    _launch(h, gate_up, act, flat_weights, al, top_k, gated=True)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=h.device)
    _launch(act, down, y, flat_weights, al, 1, gated=False)
    return y.view(n, top_k, hidden).sum(dim=1).to(h.dtype)
