"""A decode graph's static inputs loaded by one Triton kernel: the GPU form of `DecodeGraphs.load`'s torch ops.

`load` copies a step's token ids, positions, slots, sequence lengths and block-table rows into the first `n` rows
of a captured size's static buffers and makes the rest padding: five copies and five fills in torch ops, each a
driver call that costs the host more than the bytes (~20 us apiece under a sandboxed kernel, against ~1 ms of
GPU time per step for SmolLM2). Here they are one launch, one program per row of the size.

This module imports triton at module level; import it lazily (the kernel is built when the module is imported,
which is when triton decides between compiling and interpreting).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.ops.triton_attention import triton_available

__all__ = ["load_graph_inputs", "triton_available"]

_BLOCK = 128


@triton.jit
def _load_kernel(
    ids_dst, pos_dst, slot_dst, len_dst, table_dst,
    ids_src, pos_src, slot_src, len_src, table_src,
    n, width, stride_dst, stride_src, scratch_slot, scratch_block,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    if r < n:
        tl.store(ids_dst + r, tl.load(ids_src + r))
        tl.store(pos_dst + r, tl.load(pos_src + r))
        tl.store(slot_dst + r, tl.load(slot_src + r))
        tl.store(len_dst + r, tl.load(len_src + r))
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < width
            tl.store(table_dst + r * stride_dst + cols, tl.load(table_src + r * stride_src + cols, mask=ok), mask=ok)
    else:  # padding: a one-token sequence at position 0 of the scratch block
        tl.store(ids_dst + r, 0)
        tl.store(pos_dst + r, 0)
        tl.store(slot_dst + r, scratch_slot)
        tl.store(len_dst + r, 1)
        tl.store(table_dst + r * stride_dst, scratch_block)


def load_graph_inputs(
    dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # the static buffers
    src: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # the step's, n rows
    size: int,
    scratch_slot: int,
    scratch_block: int,
) -> None:
    """dst[:n] = src; rows n..size padding. Each is (input_ids, positions, slot_mapping, seq_lens, block_tables):
    int64, int64, int64, int32 and int32 [rows, blocks], as `DecodeGraphs` holds them."""
    n, width = src[0].shape[0], src[4].shape[1]
    assert n <= size <= dst[0].shape[0] and width <= dst[4].shape[1], (n, size, width, dst[4].shape)
    for d, s in zip(dst, src, strict=True):
        assert d.dtype == s.dtype and d.device == s.device and d.stride(-1) == 1 and s.stride(-1) == 1, (
            d.dtype, s.dtype, d.stride(), s.stride())
    _load_kernel[(size,)](*dst, *src, n, width, dst[4].stride(0), src[4].stride(0), scratch_slot, scratch_block,
                          BLOCK=_BLOCK, num_warps=1)
