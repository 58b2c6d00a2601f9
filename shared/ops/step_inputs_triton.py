"""Step inputs finished on the device as one Triton kernel: the GPU twin of `prepare_step_inputs_ref`.

Semantics are in `step_inputs.py`; results are bit-identical to the reference
(integers only) for valid inputs: positions stay >= 0 after the shift and
inside the sequence's block table.

    grid (num_seqs,)   one program per sequence s, scalar loads first:
        r = prev_row[s] >= 0 ?  n = num_emitted[r], shift = num_drafts[r] - (n - 1),
                                last = emitted[r, n - 1]
                     else      shift = 0
        seq_lens_out[s] = seq_lens[s] - shift
    then s's tokens [query_start_loc[s], query_start_loc[s + 1]) in tiles of BLOCK:

        tokens   | t0   t1   t2 ... | t(BLOCK) ...      (one tile per loop turn)
        ids      | last id   id ... |                   (last only if r >= 0)
        pos      | p - shift ...    |
        slot     | block_tables[s, pos // block_size] * block_size + pos % block_size

Nothing leaves the device: the loop bound is a loaded scalar, not a host int.
A `prev_row` past the last output row (every row, when `prev` is empty) gives
shift 0 and, as in the reference for an empty `prev`, id 0 for the first token.

This module imports triton at module level; import it lazily (the kernel is
built when the module is imported, which is when triton decides between
compiling and interpreting).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.ops.step_inputs import PrevOutputs, StepInputsOut
from shared.ops.triton_attention import triton_available

__all__ = ["prepare_step_inputs_triton", "triton_available"]

_BLOCK = 128


@triton.jit
def _step_inputs_kernel(
    ids_out_ptr,  # [T] int64 out
    pos_out_ptr,  # [T] int64 out
    seq_lens_out_ptr,  # [S] seq_lens' dtype out
    slot_out_ptr,  # [T] int64 out
    input_ids_ptr,  # [T] int64
    positions_ptr,  # [T] int64
    seq_lens_ptr,  # [S] int32/int64
    query_start_loc_ptr,  # [S + 1] int32/int64
    block_tables_ptr,  # [S, max_blocks] int32/int64
    prev_row_ptr,  # [S] int64
    emitted_ptr,  # [R, K + 1] int64
    num_emitted_ptr,  # [R] int64
    num_drafts_ptr,  # [R] int64
    num_rows,
    max_blocks,
    stride_bt,
    stride_em,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One sequence: its shift and last emitted id, then its tokens' ids, positions and slots."""
    s = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + s).to(tl.int64)
    end = tl.load(query_start_loc_ptr + s + 1).to(tl.int64)
    r = tl.load(prev_row_ptr + s)
    takes = r >= 0
    # rows past `prev` are never read: an empty `prev` has no memory behind its pointers
    has_row = takes & (r < num_rows)
    row = tl.where(has_row, r, 0)
    n = tl.load(num_emitted_ptr + row, mask=has_row, other=1)
    shift = tl.where(has_row, tl.load(num_drafts_ptr + row, mask=has_row, other=0) - (n - 1), 0)
    last = tl.load(emitted_ptr + row * stride_em + tl.maximum(n - 1, 0), mask=has_row, other=0)
    seq_len = tl.load(seq_lens_ptr + s)
    new_len = seq_len.to(tl.int64) - shift
    tl.store(seq_lens_out_ptr + s, new_len.to(seq_lens_out_ptr.dtype.element_ty))

    # -1 matches no token: sequences without a previous row keep their first id
    first = tl.where(takes, start, -1)
    table = block_tables_ptr + s.to(tl.int64) * stride_bt
    offs = tl.arange(0, BLOCK)
    for tile in range(start, end, BLOCK):
        idx = tile + offs
        in_seq = idx < end
        ids = tl.load(input_ids_ptr + idx, mask=in_seq, other=0)
        ids = tl.where(idx == first, last, ids)
        pos = tl.load(positions_ptr + idx, mask=in_seq, other=0) - shift
        block_idx = pos // BLOCK_SIZE
        # a position outside the table (invalid input) reads block 0 instead of stray memory
        in_table = in_seq & (block_idx >= 0) & (block_idx < max_blocks)
        block_id = tl.load(table + block_idx, mask=in_table, other=0).to(tl.int64)
        slot = block_id * BLOCK_SIZE + pos % BLOCK_SIZE
        tl.store(ids_out_ptr + idx, ids, mask=in_seq)
        tl.store(pos_out_ptr + idx, pos, mask=in_seq)
        tl.store(slot_out_ptr + idx, slot, mask=in_seq)


def _check_inputs(
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    block_tables: torch.Tensor,  # [S, max_blocks]
    prev_row: torch.Tensor,  # [S]
    prev: PrevOutputs,
) -> None:
    """Fail loudly on anything the kernel would silently misread (shapes, dtypes, layout; no values)."""
    num_tokens, num_seqs = input_ids.shape[0], seq_lens.shape[0]
    assert input_ids.dim() == 1 and positions.shape == (num_tokens,), (input_ids.shape, positions.shape)
    assert seq_lens.dim() == 1 and prev_row.shape == (num_seqs,), (seq_lens.shape, prev_row.shape)
    assert query_start_loc.shape == (num_seqs + 1,), f"query_start_loc {tuple(query_start_loc.shape)}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, block_tables.shape
    assert prev.emitted.dim() == 2, prev.emitted.shape
    num_rows = prev.emitted.shape[0]
    assert prev.num_emitted.shape == prev.num_drafts.shape == (num_rows,), (
        f"num_emitted {tuple(prev.num_emitted.shape)}, num_drafts {tuple(prev.num_drafts.shape)}, rows {num_rows}"
    )
    int64_only = {
        "input_ids": input_ids,
        "positions": positions,
        "prev_row": prev_row,
        "emitted": prev.emitted,
        "num_emitted": prev.num_emitted,
        "num_drafts": prev.num_drafts,
    }
    for name, t in int64_only.items():
        assert t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}"
    for name, t in (
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("block_tables", block_tables),
    ):
        assert t.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {t.dtype}"
    tensors = {**int64_only, "seq_lens": seq_lens, "query_start_loc": query_start_loc}
    for name, t in tensors.items():
        # emitted needs only a contiguous last dim; the rest are 1-D and must be dense
        dense = t.stride(-1) == 1 if name == "emitted" else t.is_contiguous()
        assert dense, f"{name} must be contiguous, strides {t.stride()}"
        assert t.device == input_ids.device, f"{name} on {t.device}, input_ids on {input_ids.device}"
    assert block_tables.stride(1) == 1, (
        f"block_tables last dim must be contiguous, strides {block_tables.stride()}"
    )
    assert block_tables.device == input_ids.device, f"block_tables on {block_tables.device}"


def prepare_step_inputs_triton(
    input_ids: torch.Tensor,  # [T] int64, a placeholder where the previous step's token goes
    positions: torch.Tensor,  # [T] int64, as if every draft of the previous step were accepted
    seq_lens: torch.Tensor,  # [S] int32, same assumption
    query_start_loc: torch.Tensor,  # [S + 1] int32
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    prev_row: torch.Tensor,  # [S] int64: row of `prev` that sequence continues from, -1 for none
    prev: PrevOutputs,
    block_size: int,
    *,
    block: int | None = None,
) -> StepInputsOut:
    """Same contract and results as `prepare_step_inputs_ref`; `block` overrides the token tile (tests)."""
    _check_inputs(input_ids, positions, seq_lens, query_start_loc, block_tables, prev_row, prev)
    assert block_size > 0, f"block_size {block_size}"
    block = block or _BLOCK
    assert block & (block - 1) == 0, f"block {block} must be a power of 2"
    out = StepInputsOut(
        input_ids=torch.empty_like(input_ids),
        positions=torch.empty_like(positions),
        seq_lens=torch.empty_like(seq_lens),
        slot_mapping=torch.empty_like(input_ids),
    )
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    _step_inputs_kernel[(num_seqs,)](
        out.input_ids, out.positions, out.seq_lens, out.slot_mapping,
        input_ids, positions, seq_lens, query_start_loc, block_tables, prev_row,
        prev.emitted, prev.num_emitted, prev.num_drafts,
        prev.emitted.shape[0], block_tables.shape[1], block_tables.stride(0), prev.emitted.stride(0),
        BLOCK_SIZE=block_size, BLOCK=block,
        num_warps=4,
    )  # fmt: skip
    return out
