"""Swap-in against recompute: a 2k-token context evicted from the KV pool, then wanted again.

    engine (packaged SmolLM2-135M, a pool just over one 2k context) with kv_offload_bytes on / off
    repeat, alternating the two contexts A and B (each evicts the other's blocks):
        generate(X, max_tokens=1) ─► time to first token; with the tier: X's blocks come back from
        host memory (swap-in, timed inside the engine), without it: X is computed again
    ─► swap-in p50/p95 (ms), TTFT with the tier vs without (ratio, same run), JSON in bench/results/

    .venv/bin/python -m bench.kv_swap [--context 2000] [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results
from shared.engine.request import SamplingParams
from shared.planner.metrics import percentile
from tests.helpers.models import packaged_engine

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.kv_swap")
MODEL = "smollm2-135m"
BLOCK = 16


def measure(context: int, rounds: int, offload: bool) -> dict[str, Any]:
    num_blocks = context // BLOCK + 8  # one context and a little: the other context evicts it
    engine = packaged_engine(MODEL, max_model_len=context + 16, num_kv_blocks=num_blocks,
                             max_num_batched_tokens=context + 64,
                             kv_offload_bytes=(num_blocks * 2) << 20 if offload else 0)
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(100, 20000, (context,), generator=g).tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ttft_s: list[float] = []
    for r in range(rounds + 1):
        prompt = contexts[r % 2]
        start = time.perf_counter()
        engine.generate([prompt], params)
        if r > 0:  # round 0 computes A for the first time
            ttft_s.append(time.perf_counter() - start)
        logger.info("offload=%s round %d: %.1f ms", offload, r, (time.perf_counter() - start) * 1000)
    tier = engine.kv.tier
    out: dict[str, Any] = {"ttft_ms_p50": statistics.median(ttft_s) * 1000, "ttft_ms": [t * 1000 for t in ttft_s]}
    if tier is not None:
        swaps = list(tier.stats.recent_swap_in_s)
        out |= {"swap_in_ms_p50": percentile(swaps, 50) * 1000, "swap_in_ms_p95": percentile(swaps, 95) * 1000,
                "restored_blocks": tier.stats.restored_blocks, "spilled_blocks": tier.stats.spilled_blocks,
                "block_nbytes": tier.block_nbytes, "num_swap_ins": len(swaps)}
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2000, help="tokens (SmolLM2 holds 2048)")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    recompute = measure(args.context, args.rounds, offload=False)
    swap = measure(args.context, args.rounds, offload=True)
    result = {"model": MODEL, "context_tokens": args.context, "rounds": args.rounds, "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
              "recompute": recompute, "swap_in": swap,
              "ttft_ratio_swap_over_recompute": swap["ttft_ms_p50"] / recompute["ttft_ms_p50"]}
    out = write_results(result, RESULTS, "kv_swap", indent=1)
    logger.info("wrote %s", out)
    print(json.dumps({k: result[k] for k in ("context_tokens", "ttft_ratio_swap_over_recompute")} | {
        "swap_in_ms_p50": swap.get("swap_in_ms_p50"), "swap_in_ms_p95": swap.get("swap_in_ms_p95"),
        "ttft_ms_p50_swap": swap["ttft_ms_p50"], "ttft_ms_p50_recompute": recompute["ttft_ms_p50"]}))


if __name__ == "__main__":
    main()
