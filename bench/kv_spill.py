"""A decode preempts a 2k-token context: parked in kv_transfer's pool and read back, against recomputing it.

    kv_transfer + prefill + decode in this process over real gRPC (packaged SmolLM2-135M, fp32); the decode's
    pool holds one 2k context, a short request and a few blocks more
    per stack (decode --kv-spill off, then on), per round (fresh random prompts, so no round hits the last):
        prefill a short request S, a long one L (~2k prompt) and an evictor E ─► S decodes ─► L joins ─► both
        grow until the pool is dry ─► L (the newest) is preempted ─► E takes the blocks L left cached ─► S and E
        finish ─► L resumes: recomputed (off) or read back (on) ─► resume latency (S and E done to L's next
        token); with the spill, its swap-in (timed in the engine)
    ─► swap-in p50/p95 (ms), L's resume latency with the spill over without (median ratio, same run), JSON in
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
SHORT_PROMPT, SHORT_OUT, LONG_OUT = 64, 160, 32


def _engine(max_model_len: int, num_kv_blocks: int = 0) -> dict[str, Any]:
    return dict(model=MODEL, port=0, metrics_port=-1, max_model_len=max_model_len, kv_cache_bytes=256 << 20,
                num_kv_blocks=num_kv_blocks, kv_claim_wait_s=5.0)


async def _wait_running(engine: Any, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.num_running < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"decode never ran {n} requests")
        await asyncio.sleep(0.002)


async def _prefill(stack: Stack, prompt: list[int], params: SamplingParams) -> tuple[Any, str, int]:
    """Prefill only: the handoff waits in kv_transfer until a decode claims it."""
    req, handoff_id, first = await stack.prefill_only(prompt, params)
    return req, handoff_id, first.first_token_id


async def _decode(stack: Stack, req: Any, handoff_id: str, first_token_id: int) -> list[float]:
    """Decode a prefilled request; the arrival time of each streamed message."""
    return [time.perf_counter() async for _ in stack.decode_stream(req, handoff_id, first_token_id)]


async def _wait_preempted(engine: Any, before: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.num_preemptions_total == before:
        if time.monotonic() > deadline:
            raise RuntimeError("no preemption: the decode pool is too large for this workload")
        await asyncio.sleep(0.002)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


async def measure(context: int, rounds: int, spill: bool) -> dict[str, Any]:
    """Per round: S, L and an evictor E prefilled first; S decodes, L joins (the pool holds L's prompt and S's
    first blocks with three to spare), both grow until L (the newest) is preempted; E (a prompt just short of
    L's) is then admitted into the blocks L left cached, so L's context is gone from the decode; when S and E
    are done L resumes: its resume latency is from then to its next token."""
    num_blocks = context // BLOCK + SHORT_PROMPT // BLOCK + 3
    max_len = context + LONG_OUT + BLOCK
    kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=5.0))
    prefill = await start_prefill(PrefillSettings(**_engine(max_len)))
    decode = await start_decode(DecodeSettings(**_engine(max_len, num_blocks), kv_spill=spill))
    stack = Stack(kv, prefill, decode)
    engine = decode.host.aengine.engine
    g = torch.Generator().manual_seed(0)
    resume_s: list[float] = []
    try:
        for r in range(rounds):
            short, long, evictor = (torch.randint(100, 20000, (n,), generator=g).tolist()
                                    for n in (SHORT_PROMPT, context, context - 6 * BLOCK))
            before = engine.scheduler.num_preemptions_total
            s_handoff = await _prefill(stack, short, _greedy(SHORT_OUT))
            l_handoff = await _prefill(stack, long, _greedy(LONG_OUT))
            e_handoff = await _prefill(stack, evictor, _greedy(8))
            s_task = asyncio.create_task(_decode(stack, *s_handoff))
            await _wait_running(engine, 1)
            l_task = asyncio.create_task(_decode(stack, *l_handoff))
            await _wait_preempted(engine, before)
            e_times = await _decode(stack, *e_handoff)
            s_times, l_times = await s_task, await l_task
            freed = max(s_times[-1], e_times[-1])  # when L could come back
            after = [t for t in l_times if t > freed]
            if not after:
                raise RuntimeError("the long request ended before the others: it was never evicted")
            resume_s.append(after[0] - freed)
            logger.info("spill=%s round %d: the long request resumed in %.0f ms (%d preemption(s))", spill, r,
                        resume_s[-1] * 1e3, engine.scheduler.num_preemptions_total - before)
        out: dict[str, Any] = {"resume_ms_p50": statistics.median(resume_s) * 1e3,
                               "resume_ms": [s * 1e3 for s in resume_s], "num_blocks": num_blocks,
                               "preemptions": engine.scheduler.num_preemptions_total}
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
        f"A decode preempting a {result['context_tokens']}-token context and evicting it (`bench/kv_spill.py`, "
        f"`{result['file']}`: {MODEL} fp32, kv_transfer + prefill + decode over gRPC in one process, "
        f"{result['rounds']} rounds of fresh prompts per stack; resume latency: from when the requests ahead of it "
        "are done to its next token; swap-in timed inside the engine):",
        "",
        "| decode | resume p50 ms | swap-ins | blocks read back | swap-in p50 ms | swap-in p95 ms | resume / recompute |",
        "|---|---|---|---|---|---|---|",
        f"| recompute (no spill) | {off['resume_ms_p50']:.0f} | - | - | - | - | 1.00 |",
        f"| --kv-spill | {on['resume_ms_p50']:.0f} | {on['num_swap_ins']} | {on['swapped_in_blocks']} | "
        f"{on['swap_in_ms_p50']:.1f} | {on['swap_in_ms_p95']:.1f} | {result['resume_ratio_spill_over_recompute']:.2f} |",
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
        "resume_ratio_spill_over_recompute": spill["resume_ms_p50"] / recompute["resume_ms_p50"]}
    path = write_results(result, RESULTS, "kv_spill", indent=1, record_name=True)
    logger.info("wrote %s", path)
    if not args.no_readme:
        write_block(Path(__file__).parent / "README.md", "kv_spill", readme_table(result))
    print(json.dumps({k: result[k] for k in ("context_tokens", "resume_ratio_spill_over_recompute")} | {
        "swap_in_ms_p50": spill.get("swap_in_ms_p50"), "swap_in_ms_p95": spill.get("swap_in_ms_p95"),
        "resume_ms_p50_spill": spill["resume_ms_p50"], "resume_ms_p50_recompute": recompute["resume_ms_p50"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
