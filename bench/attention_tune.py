"""The Triton paged-attention kernel's decode launches over a grid of tilings, on a lent GPU.

At batch 1 on an H200 a SmolLM2 decode step spent 6.9 us a layer in attention (cuda_loop-20261127-034114-
kernels-b1.txt, 30 calls a step): three programs (one per KV head) walking the context in tiles of 64 keys, each
tile a block-table read and then the keys. This times the decode launch with SmolLM2's heads (9 query heads over
3 KV heads of 64, blocks of 16 slots) at a few batch sizes and context lengths, for every tiling of the grid
(keys a tile, warps, pipeline stages), inside a CUDA graph as a captured step runs it, and checks each against
the torch reference. Every tiling is in the JSON; "best" gives the fastest per case beside the default's time.

    python -m bench.attention_tune [--batch 1 8] [--context 192 1024]      (--device cpu: a smoke run)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial
from typing import Any

import torch

from bench.gemv_tune import add_device_args, device_setup, log
from bench.results_file import write_results
from shared.ops.attention import AttentionMetadata, paged_attention_ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M, the engine's default block size
GRID = {"block_n": (32, 64, 128, 256), "num_warps": (2, 4), "num_stages": (1, 2)}
QUICK_GRID = {"block_n": (32, 128), "num_warps": (4,), "num_stages": (1,)}


def decode_batch(batch: int, context: int, dtype: torch.dtype, device: str,
                 gen: torch.Generator) -> tuple[tuple[Any, ...], AttentionMetadata]:
    """`batch` sequences of `context` keys already in a paged cache (blocks in shuffled order), one query each."""
    blocks = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks] + 1).view(batch, blocks)
    last = context - 1
    meta = AttentionMetadata(
        slot_mapping=(tables[:, last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE).to(device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device, torch.int32),
        query_lens_host=[1] * batch, seq_lens_host=[context] * batch)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    return (query, query, query, k_cache, v_cache, meta, HEAD_DIM ** -0.5), meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[192, 1024])
    parser.add_argument("--quick", action="store_true", help="a 2-point grid")
    add_device_args(parser)
    args = parser.parse_args()
    dtype, bench = device_setup(args, "attention_tune.py")
    from shared.ops import triton_attention as ta

    grid = QUICK_GRID if args.quick else GRID
    tilings = [ta.DecodeTiling(*values) for values in itertools.product(*grid.values())]
    untuned = ta.DecodeTiling()  # prefill's tiles: "default_us" below, the baseline of the measured rule
    gen = torch.Generator().manual_seed(0)
    points: list[dict[str, Any]] = []
    best: dict[str, Any] = {}
    t0 = time.perf_counter()
    for batch, context in itertools.product(args.batch, args.context):
        call, _ = decode_batch(batch, context, dtype, args.device, gen)
        want = paged_attention_ref(*call).float()
        row: dict[str, Any] = {"batch": batch, "context": context, "tilings": []}
        for tiling in [untuned, *tilings]:
            old = ta.use_decode_tiling(tiling)
            try:
                got = ta.paged_attention_triton(*call).float()
                err = float((got - want).abs().max() / want.abs().max())
                us = bench(partial(ta.paged_attention_triton, *call))
                row["tilings"].append({**tiling.__dict__, "us": round(us, 2), "max_rel_err": round(err, 5)})
            except Exception as e:  # a tiling that does not compile: recorded
                row["tilings"].append({**tiling.__dict__, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            finally:
                ta.use_decode_tiling(old)
        timed = [t for t in row["tilings"] if "us" in t]
        if timed:
            fastest = min(timed, key=lambda t: t["us"])
            best[f"b{batch}-ctx{context}"] = {"fastest": fastest, "default_us": timed[0]["us"]}
        log(f"[{time.perf_counter() - t0:.0f} s] batch {batch} context {context}: "
            f"{json.dumps(best.get(f'b{batch}-ctx{context}'))}")
        points.append(row)
    result = {"bench": "attention_tune", "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else args.device, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
              "heads": [HEADS, KV_HEADS, HEAD_DIM], "block_size": BLOCK_SIZE,
              "grid": {k: list(v) for k, v in grid.items()}, "best": best, "points": points}
    path = write_results(result, args.out, "attention_tune", record_name=True)
    print(json.dumps({"file": path.name, "best": best}))


if __name__ == "__main__":
    main()
