"""Paged attention on the CPU: C++ kernels for short rows and for causal prompt chunks, the torch reference
for the rest.

The reference gathers every decoding sequence's context out of the paged cache
into a contiguous copy before SDPA, once per layer: a quarter of a batch-32
decode step on two cores (bench/decode_profile.py). `csrc/paged_decode_cpu.cpp`
reads the blocks in place instead (built by `cpu_kernels.py`). A prompt chunk
goes to `csrc/prefill_attention_cpu.cpp`, which skips the masked half of its
triangle (torch's CPU SDPA computed it: 1.2 ms against 0.73 for a 256-token
chunk of SmolLM2 on two Zen 4 cores); chunks with a draft tree or a
bidirectional image span keep SDPA with their mask. Where the kernels do not
build, or for dtypes other than float32, the reference runs.
"""

from __future__ import annotations

import os

import torch

from shared.ops.attention import (
    AttentionMetadata,
    paged_attention_ref,
    paged_attention_split,
    query_positions,
    split_sequences,
)
from shared.ops.cpu_kernels import cpu_kernels_available

_ENABLED = os.environ.get("BATON_CPU_ATTENTION_KERNEL", "1") != "0"


def cpu_kernel_available() -> bool:
    """The attention kernel runs unless BATON_CPU_ATTENTION_KERNEL=0 (or the CPU kernels did not build)."""
    return _ENABLED and cpu_kernels_available()


def _short_rows(meta: AttentionMetadata, seq_ids: list[int], starts: list[int],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query rows, their sequence, their position) of the short sequences, built once per step."""
    key = "cpu-short-rows"
    cached = meta.step_cache.get(key)
    if cached is None:
        rows = [starts[i] + t for i in seq_ids for t in range(meta.query_lens_host[i])]
        seqs = [i for i in seq_ids for _ in range(meta.query_lens_host[i])]
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        pos = query_positions(meta, device)[row_index]
        cached = meta.step_cache[key] = (row_index, torch.tensor(seqs, dtype=torch.int64, device=device), pos)
    return cached  # type: ignore[return-value]


def kernel_rows(meta: AttentionMetadata,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """paged_decode's (rows, row_seq, row_pos) when the kernel takes every row of the step (no chunk goes to
    the reference), else None: the C++ layer loop (shared/models/cpu_layer_loop.py) runs only then."""
    short_seqs, long_seqs, starts = split_sequences(meta)
    if long_seqs or not short_seqs:
        return None
    return _short_rows(meta, short_seqs, starts, device)


def _short_batch_kernel(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: int | None, seq_ids: list[int], starts: list[int],
                        out: torch.Tensor) -> None:
    rows, row_seq, row_pos = _short_rows(meta, seq_ids, starts, query.device)
    torch.ops.baton_cpu.paged_decode(out, query, k_cache, v_cache, meta.block_tables, rows, row_seq, row_pos,
                                     scale, sliding_window or 0)


def _long_chunk_kernel(out: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scale: float, sliding_window: int | None) -> None:
    torch.ops.baton_cpu.prefill_attention(out, query, keys, values, scale, sliding_window or 0)


def write_kv_cpu(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    index: tuple[torch.Tensor, torch.Tensor] | None = None,  # unused: the op splits the slots itself
) -> None:
    """`write_kv`'s contract in one C++ op (`csrc/write_kv_cpu.cpp`): the same bytes at the same slots."""
    torch.ops.baton_cpu.write_kv_(k_cache, v_cache, key, value, slot_mapping)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (this step's keys, already written)
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as `paged_attention_ref`; short rows read the cache in place when the kernel runs."""
    if query.dtype != torch.float32 or query.is_cuda or not cpu_kernel_available():
        return paged_attention_ref(query, key, value, k_cache, v_cache, meta, scale, sliding_window)
    return paged_attention_split(query, key, value, k_cache, v_cache, meta, scale, sliding_window,
                                 _short_batch_kernel, _long_chunk_kernel)
