"""A decode preempts a 2k-token context: parked in kv_transfer's pool and read back, against recomputing it.

    kv_transfer + prefill + decode in this process over real gRPC (packaged SmolLM2-135M, fp32); the decode's
    pool holds one 2k context, a short request and a few blocks more
    per stack (decode --kv-spill off, then on), per round (fresh random prompts, so no round hits the last):
        a short request S starts decoding ─► a long one L (~2k prompt) joins ─► both grow until the pool is dry
        ─► L (the newest) is preempted ─► S finishes ─► L resumes: recomputed (off) or read back (on)
        ─► L's end-to-end latency; with the spill, its swap-in time (timed inside the engine)
    ─► swap-in p50/p95 (ms), L's latency with the spill over without (median ratio, same run), JSON in
       bench/results/kv_spill-*.json and bench/README.md's table

    .venv/bin/python -m bench.kv_spill [--context 2000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results
from bench.serve_report import write_block
from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from shared.engine.request import SamplingParams
from shared.planner.metrics import percentile
from tests.integration.services.test_disagg_grpc import Stack

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.kv_spill")
MODEL = "smollm2-135m"
BLOCK = 16
SHORT_PROMPT, SHORT_OUT, LONG_OUT = 64, 48, 32


def _engine(max_model_len: int, num_kv_blocks: int = 0) -> dict[str, Any]:
    return dict(model=MODEL, port=0, metrics_port=-1, max_model_len=max_model_len, kv_cache_bytes=256 << 20,
                num_kv_blocks=num_kv_blocks, kv_claim_wait_s=5.0)


async def _wait_running(engine: Any, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.num_running < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"decode never ran {n} requests")
        await asyncio.sleep(0.002)


async def measure(context: int, rounds: int, spill: bool) -> dict[str, Any]:
    # one long context grown by its output, the short request grown by its own, two blocks of slack: the
    # long one runs out of room while both decode
    num_blocks = (context + LONG_OUT) // BLOCK + (SHORT_PROMPT + SHORT_OUT) // BLOCK - 2
    max_len = context + LONG_OUT + BLOCK
    kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=5.0))
    prefill = await start_prefill(PrefillSettings(**_engine(max_len)))
    decode = await start_decode(DecodeSettings(**_engine(max_len, num_blocks), kv_spill=spill))
    stack = Stack(kv, prefill, decode)
    engine = decode.host.aengine.engine
    g = torch.Generator().manual_seed(0)
    long_s: list[float] = []
    try:
        for r in range(rounds):
            short = torch.randint(100, 20000, (SHORT_PROMPT,), generator=g).tolist()
            long = torch.randint(100, 20000, (context,), generator=g).tolist()
            before = engine.scheduler.num_preemptions_total
            s_task = asyncio.create_task(stack.generate(short, SamplingParams(
                max_tokens=SHORT_OUT, min_tokens=SHORT_OUT, temperature=0.0)))
            await _wait_running(engine, 1)
            started = time.perf_counter()
            await stack.generate(long, SamplingParams(max_tokens=LONG_OUT, min_tokens=LONG_OUT, temperature=0.0))
            long_s.append(time.perf_counter() - started)
            await s_task
            preempted = engine.scheduler.num_preemptions_total - before
            logger.info("spill=%s round %d: long request %.0f ms, %d preemption(s)", spill, r,
                        long_s[-1] * 1e3, preempted)
            if preempted == 0:
                raise RuntimeError("no preemption: the decode pool is too large for this workload")
        out: dict[str, Any] = {"long_ms_p50": statistics.median(long_s) * 1e3, "long_ms": [s * 1e3 for s in long_s],
                               "num_blocks": num_blocks, "preemptions": engine.scheduler.num_preemptions_total}
        if engine.spill is not None and engine.remote is not None:
            swaps = list(engine.spill.recent_swap_in_s)
            stats = engine.remote.stats.by_direction
            out |= {"swap_in_ms_p50": percentile(swaps, 50) * 1e3, "swap_in_ms_p95": percentile(swaps, 95) * 1e3,
                    "num_swap_ins": len(swaps), "swapped_in_blocks": engine.spill.swapped_in_blocks,
                    "swap_in_bytes": stats["swap_in"].nbytes, "spilled_units": engine.spill.spilled_units,
                    "spill_ms_mean": stats["spill"].sum_s / max(stats["spill"].count, 1) * 1e3,
                    "spill_bytes": stats["spill"].nbytes, "failures": stats["spill"].failures
                    + stats["swap_in"].failures}
        return out
    finally:
        for service in (decode, prefill, kv):
            await service.stop()


def readme_table(result: dict[str, Any]) -> str:
    on, off = result["spill"], result["recompute"]
    return "\n".join([
        f"A decode preempting a {result['context_tokens']}-token context (`bench/kv_spill.py`, `{result['file']}`: "
        f"{MODEL} fp32, kv_transfer + prefill + decode over gRPC in one process, {result['rounds']} rounds of "
        "fresh prompts per stack; the long request's end-to-end latency, its swap-in timed inside the engine):",
        "",
        "| decode | long request p50 ms | swap-ins | blocks read back | swap-in p50 ms | swap-in p95 ms | "
        "latency / recompute |",
        "|---|---|---|---|---|---|---|",
        f"| recompute (no spill) | {off['long_ms_p50']:.0f} | - | - | - | - | 1.00 |",
        f"| --kv-spill | {on['long_ms_p50']:.0f} | {on['num_swap_ins']} | {on['swapped_in_blocks']} | "
        f"{on['swap_in_ms_p50']:.1f} | {on['swap_in_ms_p95']:.1f} | {result['latency_ratio_spill_over_recompute']:.2f} |",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2000, help="the long prompt's tokens (SmolLM2 holds 2048)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    recompute = asyncio.run(measure(args.context, args.rounds, False))
    spill = asyncio.run(measure(args.context, args.rounds, True))
    result: dict[str, Any] = {
        "bench": "kv_spill", "model": MODEL, "context_tokens": args.context, "rounds": args.rounds,
        "recompute": recompute, "spill": spill,
        "latency_ratio_spill_over_recompute": spill["long_ms_p50"] / recompute["long_ms_p50"]}
    path = write_results(result, RESULTS, "kv_spill", indent=1, record_name=True)
    logger.info("wrote %s", path)
    if not args.no_readme:
        write_block(Path(__file__).parent / "README.md", "kv_spill", readme_table(result))
    print(json.dumps({k: result[k] for k in ("context_tokens", "latency_ratio_spill_over_recompute")} | {
        "swap_in_ms_p50": spill.get("swap_in_ms_p50"), "swap_in_ms_p95": spill.get("swap_in_ms_p95"),
        "long_ms_p50_spill": spill["long_ms_p50"], "long_ms_p50_recompute": recompute["long_ms_p50"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
