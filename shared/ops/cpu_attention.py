"""Paged attention on the CPU: a C++ kernel for short rows, the torch reference for the rest.

The reference gathers every decoding sequence's context out of the paged cache
into a contiguous copy before SDPA, once per layer: a quarter of a batch-32
decode step on two cores (bench/decode_profile.py). `csrc/paged_decode_cpu.cpp`
reads the blocks in place instead. It is built once per machine with the C++
compiler torch uses (about 30 s, cached under the baton cache dir) on first
use; where it does not build, or for dtypes other than float32, the reference
runs and says so once. Prefill chunks keep the reference's SDPA path.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from shared.models.loader import DEFAULT_CACHE_DIR
from shared.ops.attention import (
    AttentionMetadata,
    paged_attention_ref,
    paged_attention_split,
    query_positions,
)

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_lock = threading.Lock()
_built: bool | None = None


def _build_dir() -> Path:
    return DEFAULT_CACHE_DIR / "torch_extensions" / f"torch-{torch.__version__}"


def cpu_kernel_available() -> bool:
    """Build (once per process; the compiled library is cached on disk) and load the kernel."""
    global _built
    if _built is not None:  # every layer of every step asks: no lock once settled
        return _built
    with _lock:
        if _built is None:
            _built = _build()
        return _built


def _build() -> bool:
    if os.environ.get("BATON_CPU_ATTENTION_KERNEL", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        logger.info("building the CPU attention kernel (cached in %s)", build_dir)
        # -fopenmp only compiles at::parallel_for's pragmas: the symbols come from torch's own libgomp
        load(name="baton_paged_decode_cpu", sources=[str(_SOURCE)], extra_cflags=["-O3", "-march=native",
             "-fopenmp"], build_directory=str(build_dir), is_python_module=False, verbose=False)
        return True
    except Exception as exc:  # no compiler, headers, ...: serve with the reference
        logger.warning("CPU attention kernel unavailable (%s): using the torch reference", exc)
        return False


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


def _short_batch_kernel(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: int | None, seq_ids: list[int], starts: list[int],
                        out: torch.Tensor) -> None:
    rows, row_seq, row_pos = _short_rows(meta, seq_ids, starts, query.device)
    torch.ops.baton_cpu.paged_decode(out, query, k_cache, v_cache, meta.block_tables, rows, row_seq, row_pos,
                                     scale, sliding_window or 0)


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
                                 _short_batch_kernel)
