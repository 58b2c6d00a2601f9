"""CUDA graphs for Gemma 4's vision encoder: one captured tower-and-embedder pass per image-size bucket.

The tower over one image is ~20 kernels a layer; on a GPU, launched one by one
from Python, the host takes longer than the GPU runs them, as with decode steps
(shared/engine/cuda_graphs.py). vLLM captures its vision encoders whole; so does
this, per bucket of soft tokens (the image processor's budgets, 70 ... 1120):

    image (n patches, n / k^2 cells) ──smallest bucket of C >= n / k^2 cells──►
        static buffers [C * k^2 rows]: the patches, then zero rows masked as keys
        and read by no real cell ──replay──► [C, text hidden]; the first n / k^2 rows are the image's

Each image replays on its own (the eager path batches several into one pass);
an image larger than every bucket runs eagerly, as do all above GRAPHED_UP_TO
soft tokens, where the tower is compute-bound. The padded pass
(`VisionTower.forward_padded`) has no host synchronization, so the same code runs
eagerly on any device (the CPU tests) and is what CUDA captures.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from shared.models.gemma4.vision import VisionTower, cell_rows

logger = logging.getLogger(__name__)

# the soft-token budgets transformers' Gemma 4 image and video processors accept (max_soft_tokens)
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
# the largest bucket captured: past it the tower is compute-bound and a graph's masked attention loses to eager
# flash attention (H100, bf16, the published tower: graph over eager 3.6x at 70 soft tokens, 3.4x at 280, 2.0x at
# 560, 0.93x at 1120; bench/results/vision_graphs-20261126-185655.json)
GRAPHED_UP_TO = 560


def budgets_up_to(max_soft_tokens: int) -> list[int]:
    """The buckets for a processor whose images get at most `max_soft_tokens`: every budget up to its own, none
    past GRAPHED_UP_TO (larger images run eagerly)."""
    top = min(max_soft_tokens, GRAPHED_UP_TO)
    return [b for b in SOFT_TOKEN_BUDGETS if b < top] + [top]


class _Bucket:
    """Static inputs and output of one bucket (C cells, C * k^2 patch rows)."""

    def __init__(self, cells: int, k: int, patch_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        rows = cells * k * k
        self.cells = cells
        self.patches = torch.zeros(rows, patch_dim, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, 2, dtype=torch.int64, device=device)
        self.key_mask = torch.zeros(rows, dtype=torch.bool, device=device)
        self.cell_rows = torch.zeros(cells, k * k, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None  # [cells, text hidden], the graph's


class VisionGraphs:
    """The buckets of one tower and embedder; `encode` runs an image through its bucket (a replay once
    `capture` has run, else the same padded pass eagerly)."""

    def __init__(self, tower: VisionTower, embed: Callable[[torch.Tensor], torch.Tensor], cells: Sequence[int],
                 dtype: torch.dtype) -> None:
        s = tower.spec
        self.tower, self.embed, self.k = tower, embed, s.pooling_kernel_size
        self.dtype = dtype
        self.buckets = [_Bucket(c, self.k, 3 * s.patch_size**2, tower.dtype, tower.device) for c in sorted(set(cells))]
        self._cells = [b.cells for b in self.buckets]
        self.num_replays = 0

    @property
    def captured(self) -> bool:
        return bool(self.buckets) and all(b.graph is not None for b in self.buckets)

    def bucket_for(self, num_patches: int) -> _Bucket | None:
        """The smallest bucket that holds an image of `num_patches` patches, or None."""
        i = bisect.bisect_left(self._cells, -(-num_patches // (self.k * self.k)))
        return self.buckets[i] if i < len(self.buckets) else None

    def fits(self, num_patches: int) -> bool:
        return self.bucket_for(num_patches) is not None

    def encode(
        self,
        patches: torch.Tensor,  # [n, 3 * p * p]
        positions: torch.Tensor,  # [n, 2]
    ) -> torch.Tensor:  # [n / k^2, text hidden], a tensor of its own
        n = patches.shape[0]
        bucket = self.bucket_for(n)
        assert bucket is not None, f"no bucket holds {n} patches"
        self._load(bucket, patches, positions)
        if bucket.graph is not None:
            bucket.graph.replay()
            self.num_replays += 1
            assert bucket.output is not None
            out = bucket.output
        else:
            out = self._forward(bucket)
        return out[: n // (self.k * self.k)].clone()

    def capture(self) -> None:
        """Record one graph per bucket (largest first, sharing one memory pool); CUDA only."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            bucket.key_mask.fill_(True)  # warm up on a whole image: cuBLAS and SDPA pick their kernels
            bucket.cell_rows.copy_(torch.arange(bucket.cell_rows.numel(), device=bucket.cell_rows.device)
                                   .view_as(bucket.cell_rows))
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                bucket.output = self._forward(bucket)
            bucket.graph = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of the vision encoder for images of %s soft tokens in %.1f s",
                    self._cells, time.perf_counter() - t0)

    @torch.inference_mode()
    def _forward(self, b: _Bucket) -> torch.Tensor:  # [cells, text hidden]
        pooled = self.tower.forward_padded(b.patches, b.positions, b.key_mask, b.cell_rows)
        return self.embed(pooled.to(self.dtype))

    def _load(self, b: _Bucket, patches: torch.Tensor, positions: torch.Tensor) -> None:
        """An image into a bucket's first rows; the rest padding (zeros, masked, in no real cell)."""
        n = patches.shape[0]
        rows = cell_rows(positions, self.k) if self.k > 1 else torch.arange(n)[:, None]
        b.patches[:n].copy_(patches)
        b.patches[n:].zero_()
        b.positions[:n].copy_(positions)
        b.positions[n:].zero_()
        b.key_mask[:n].fill_(True)
        b.key_mask[n:].fill_(False)
        b.cell_rows[: rows.shape[0]].copy_(rows)
        b.cell_rows[rows.shape[0]:].zero_()
