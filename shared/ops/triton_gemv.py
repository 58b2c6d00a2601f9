"""A decode step's projections for a few rows, with the ops around them folded in: one Triton kernel.

At batch 1-16 a projection is a matrix-vector product bound by launch latency and the weight's bytes, and the
ops between projections (a residual add, an RMSNorm, SiLU * up) are launches of their own. This kernel takes
them into its prologue and epilogue, so a Llama layer's decode step is six launches (this kernel four times,
RoPE + KV store, attention) instead of nine:

    qkv   = W_qkv  @ rms_norm(x)                  prologue: the norm, recomputed by each program (K is small)
    x     = x + W_o @ attn                        epilogue: the residual add
    act   = silu(W_gate @ h) * (W_up @ h),        prologue: the norm; epilogue: two accumulators, gate and up
            h = rms_norm(x)                       rows of the same columns, and SiLU * up
    x     = x + W_down @ act                      epilogue: the residual add

Each program owns BLOCK_N output columns for every row and walks K in tiles, multiplying either on the tensor
cores (rows padded to 16, tiles of 16 columns or more) or, for one to a few rows, as products summed in
registers: at batch 1 a projection is a few hundred KB and its time is the round trips to memory, so many small
programs (BLOCK_N down to 2) and one or two K tiles can beat the padded dot. Which tiling a projection takes is
looked up by its shape (`config_for`: a table filled from bench/gemv_tune.py on a lent GPU, DEFAULT_CONFIG
elsewhere). Rounding follows the separate ops: the norm's output, each product and the activation are rounded
to the activation dtype where the torch ops round them, so only the dot's summation order differs.

This module imports triton at module level; import it lazily (the kernel is built when the module is imported,
which is when triton decides between compiling and interpreting).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from shared.ops.triton_attention import triton_available

__all__ = ["DEFAULT_CONFIG", "MAX_ROWS", "GemvConfig", "config_for", "gemv", "triton_available",
           "tuned_table", "use_tuned_table"]

MAX_ROWS = 16  # one tensor-core tile of rows; larger batches take cuBLAS and the separate kernels


@dataclass(frozen=True)
class GemvConfig:
    """How the kernel tiles the work: BLOCK_N output columns a program, K in tiles of BLOCK_K, on the tensor
    cores (`dot`; block_n >= 16) or as products summed in registers."""

    block_n: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True


# Two to sixteen rows, on the tensor cores. H200, SmolLM2 at batch 1: 6.0 us a call (cuda_loop-20261127-034114-
# kernels-b1.txt); bench/gemv_tune.py times a grid of these against cuBLAS on a lent GPU.
DEFAULT_CONFIG = GemvConfig()


def one_row_config(k: int) -> GemvConfig:
    """One row: four columns a program, K in one tile up to 2048, products summed in registers. On an H200 within
    10% of the fastest of 12-18 tilings for each of SmolLM2's projections and 1.4-2.1x the tensor-core default
    (2.2-3.5 us a call against 3.0-6.1; gemv_tune-20261127-191229.json), so shapes nobody tuned start here."""
    return GemvConfig(block_n=4, block_k=min(triton.next_power_of_2(k), 2048), num_warps=4, num_stages=1,
                      dot=False)

# The fastest tilings bench/gemv_tune.py found, per GPU model: {device name: {"<proj>@<rows>": {"n", "k", "gated",
# "config"}}} (the "best" of a gemv_tune result, as vLLM keeps its fused-MoE tilings per device)
TUNED_FILE = Path(__file__).with_name("triton_gemv_tuned.json")

ConfigTable = dict[tuple[int, int, bool, int], GemvConfig]  # (N, K, gated, rows bucket) -> tiling
_tuned: ConfigTable | None = None  # loaded on first use, for the device in use


def _rows_bucket(rows: int) -> int:
    return 1 if rows <= 1 else 8 if rows <= 8 else 16


def tuned_table(best: dict[str, dict[str, Any]]) -> ConfigTable:
    """A gemv_tune result's "best" as a lookup table; a shape tuned at 8 rows serves 2 to 8 (and 9 to 16)."""
    table: ConfigTable = {}
    for key, entry in best.items():
        rows = _rows_bucket(int(key.rsplit("@", 1)[1]))
        shape = (int(entry["n"]), int(entry["k"]), bool(entry["gated"]))
        table[(*shape, rows)] = GemvConfig(**entry["config"])
        if rows == 8:
            table.setdefault((*shape, 16), table[(*shape, rows)])
    return table


def _load_tuned() -> ConfigTable:
    if not torch.cuda.is_available() or not TUNED_FILE.exists():
        return {}
    return tuned_table(json.loads(TUNED_FILE.read_text()).get(torch.cuda.get_device_name(), {}))


def config_for(rows: int, n: int, k: int, gated: bool) -> GemvConfig:
    """The tiling for a projection of this shape at this many rows: tuned where a run measured it."""
    global _tuned
    if _tuned is None:
        _tuned = _load_tuned()
    tuned = _tuned.get((n, k, gated, _rows_bucket(rows)))
    return tuned if tuned is not None else one_row_config(k) if rows <= 1 else DEFAULT_CONFIG


def use_tuned_table(table: ConfigTable | None) -> ConfigTable | None:
    """Serve from `table` (None: the file's, reloaded); returns the table it replaces. bench/cuda_loop.py times
    one model with and without a fresh tuning in one run."""
    global _tuned
    old, _tuned = _tuned, table
    return old


@triton.jit
def _dot(h, w, IEEE_FP32: tl.constexpr):
    """h @ w.T accumulated in fp32. IEEE_FP32: in fp32 without TF32 (fp32 models, and the interpreter, whose
    bf16 dot is wrong; a bf16 product is exact in fp32, so the sums are the same)."""
    if IEEE_FP32:
        return tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(h, tl.trans(w))


@triton.jit
def _rowdot(h, w, DOT: tl.constexpr, IEEE_FP32: tl.constexpr):
    """h [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T in fp32: on the tensor cores, or as products summed in
    registers (exact products of bf16 in fp32, so only the summation order differs)."""
    if DOT:
        return _dot(h, w, IEEE_FP32)
    else:
        return tl.sum(h.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, norm_ptr,
    M, N, K, stride_x, stride_w, stride_o, stride_r, eps,
    NORM: tl.constexpr, NORM_IN_FP32: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    IEEE_FP32: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    dt = x_ptr.dtype.element_ty
    if NORM:  # each row's mean square over all of K first (K is a hidden size: a few KB from L2)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :],
                         other=0.0).to(tl.float32)
            sq += tl.sum(xv * xv, axis=1)
        inv = tl.math.rsqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        h = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            nw = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            hf = h.to(tl.float32) * inv[:, None]
            if NORM_IN_FP32:  # Gemma's (1 + w) in fp32, then the cast
                h = (hf * nw[None, :]).to(dt)
            else:  # Llama: cast back, then the weight in the activation dtype
                h = (hf.to(dt).to(tl.float32) * nw[None, :]).to(dt)
        w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _rowdot(h, w, DOT, IEEE_FP32)
        if GATED:  # the up rows of the same columns sit N rows further down the gate_up weight
            wu = tl.load(w_ptr + (cols + N)[:, None] * stride_w + ks[None, :],
                         mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up += _rowdot(h, wu, DOT, IEEE_FP32)
    y = acc.to(dt)
    if GATED:  # silu(gate) rounded as F.silu rounds it, then * up
        g = y.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt)
        y = (act.to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    mask = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=mask)


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def gemv(
    x: torch.Tensor,  # [M <= MAX_ROWS, K]
    weight: torch.Tensor,  # [N, K] ([2 * N, K] gated: gate rows, then up rows)
    *,
    norm_weight: torch.Tensor | None = None,  # RMSNorm x first with this weight [K]
    eps: float = 1e-6,
    norm_in_fp32: bool = False,  # the norm weight is Gemma's (1 + w), applied in fp32
    residual: torch.Tensor | None = None,  # [M, N]: add it to the product
    gated: bool = False,  # silu(gate @ h) * (up @ h)
    config: GemvConfig | None = None,  # None: config_for this shape
) -> torch.Tensor:  # [M, N]
    """`weight @ x` for each row of x with an optional RMSNorm before and residual add or SiLU gate after."""
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1, (
        x.shape, weight.shape, x.stride())
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == (rows, n) and residual.stride(-1) == 1 and residual.dtype == x.dtype, residual.shape
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous(), norm_weight.shape
    if rows:
        config = config or config_for(rows, n, k, gated)
        assert config.block_n >= 16 or not config.dot, config
        res = residual if residual is not None else out
        _gemv_kernel[(triton.cdiv(n, config.block_n),)](
            x, weight, out, res, norm_weight if norm_weight is not None else weight,
            rows, n, k, x.stride(0), weight.stride(0), out.stride(0), res.stride(0), eps,
            NORM=norm_weight is not None, NORM_IN_FP32=norm_in_fp32, RESIDUAL=residual is not None, GATED=gated,
            IEEE_FP32=x.dtype == torch.float32 or _interpreting(), DOT=config.dot,
            BLOCK_M=MAX_ROWS if config.dot else triton.next_power_of_2(rows), BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out
