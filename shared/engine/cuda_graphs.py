"""CUDA graphs for decode steps: one captured forward per padded batch size.

A decode step of a small model is a thousand tiny kernels (about 35 per layer);
launched one by one from Python the host takes ~10x longer than the GPU runs
them (H100, SmolLM2-135M, batch 8: 30 ms of host time for 2.8 ms of kernels,
bench/cuda_loop.py). Replaying a captured graph launches them all at once.

A graph fixes its tensors' addresses and shapes, so each captured size reads
static input buffers: a step of `n` single-token sequences is copied into the
first `n` rows of the smallest captured size >= n, and the remaining rows are
padding, pointed at a scratch block that the block pool never hands out (their
K/V writes land there, their attention reads one slot of it, their outputs are
dropped). Steps with longer chunks (prefill, verification of drafts), steps
whose hidden states leave the engine, and batches above the largest size run
eagerly, as with vLLM's CUDA graphs.

The buffers and padding work on any device (`load` is tested on the CPU);
capture and replay need CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from shared.ops.attention import AttentionMetadata

logger = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
_MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to the first size that holds `max_num_seqs` (at most 256)."""
    want = min(max(max_num_seqs, 1), _MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, _MAX_CAPTURE_SIZE + 1, 8)]
    return sizes[: bisect.bisect_left(sizes, want) + 1]


class DecodeGraphs:
    """Static decode inputs for up to `sizes[-1]` sequences and, on CUDA, one graph per size."""

    def __init__(self, sizes: list[int], max_blocks_per_seq: int, block_size: int, scratch_block: int,
                 device: torch.device) -> None:
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.max_seq_len = max_blocks_per_seq * block_size
        size = self.sizes[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((size, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size holding `num_seqs` sequences, or None."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, meta: AttentionMetadata) -> bool:
        """A step of single-token sequences that a captured size holds."""
        return (
            meta.num_seqs > 0
            and meta.max_query_len == 1
            and self.size_for(meta.num_seqs) is not None
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def meta(self, size: int) -> AttentionMetadata:
        """Metadata over the first `size` rows of the static buffers.

        The host lists are what a graph bakes in: every row one query token; seq_lens_host is
        only an upper bound (the kernel reads the device seq_lens).
        """
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_host=[1] * size,
            seq_lens_host=[self.max_seq_len] * size,
            positions=self.positions[:size],
        )

    def load(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a step's inputs into the first rows and make rows up to `size` padding.

        Padding is rewritten every step: a row that held a live sequence last step must not
        write into that sequence's blocks now.
        """
        if self.input_ids.is_cuda:  # one launch in place of up to ten copies and fills (graph_inputs_triton.py)
            from shared.ops.graph_inputs_triton import load_graph_inputs

            load_graph_inputs(self._static(), (input_ids, positions, meta.slot_mapping, meta.seq_lens,
                                               meta.block_tables), size, self.scratch_slot, self.scratch_block)
            return
        self.load_reference(size, input_ids, positions, meta)

    def _static(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables

    def load_reference(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> None:
        """`load` in torch ops (the CPU's, and the kernel's reference)."""
        n = input_ids.shape[0]
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.scratch_slot)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(self.scratch_block)

    def capture(self, forward: ForwardFn) -> None:
        """Record one graph per size (largest first, sharing one memory pool)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            args = (self.input_ids[:size], self.positions[:size], self.meta(size))
            for _ in range(2):  # compile the Triton kernels and set up cuBLAS outside the capture
                forward(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._outputs[size] = forward(*args)
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batches of %s in %.1f s", self.sizes, time.perf_counter() - t0)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph of the smallest size holding this step; its hidden states, [n, hidden].

        The result lives in the graph's memory: use it before the next replay (the engine does,
        on the same stream).
        """
        n = input_ids.shape[0]
        size = self.size_for(n)
        assert size is not None and size in self._graphs, f"no graph holds {n} sequences"
        self.load(size, input_ids, positions, meta)
        self._graphs[size].replay()
        self.num_replays += 1
        return self._outputs[size][:n]
