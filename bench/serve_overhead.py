"""The serving overhead: one stream served against the same engine in-process, same prompts, same run.

    round r (each --rounds):  engine in-process, all cores' threads ─► engine, one thread
                              ─► `baton up --mode colocated`, one stream ─► `baton up` (disaggregated), one stream
    ─► JSON in bench/results/serve_overhead-*.json (last stdout line: the summary)

Every system decodes the same random-token prompts (256 ids in, exactly 128 out, greedy, one request at a
time), and every figure is output tokens over the wall time of the requests, prefill included, as
`bench/serve.py` counts its c=1 point. The in-process engine gets each prompt with an empty prefix cache,
like a served random prompt. `served / engine` is the issue's ratio (target ≥ 0.9), taken per round
against that round's engine run so the machine's drift reaches both; the one-thread engine is recorded
beside it because the disaggregated decode engine is given one torch thread of its own when prefill is
busy. TTFT and TPOT (p50) come with each figure, so a gap can be placed in prefill or in the decode loop.

    .venv/bin/python -m bench.serve_overhead [--precision float32|bfloat16|int8|...] [--rounds 2] [--quick]
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
from bench.serve import vocab_ids
from bench.serve_load import RequestSpec, random_token_set, warm_up
from bench.serve_machine import machine_info
from bench.serve_point import run_point
from bench.serve_systems import BATON_ENV, MODEL_NAME, PRECISION_FLAGS, Server, ServerConfig, export_hf
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.serve")


def engine_config(precision: str) -> dict[str, str]:
    """`baton up`'s precision flags (bench/serve_systems.py) as EngineConfig fields, so both run one setting."""
    flags = PRECISION_FLAGS[precision]
    names = {"--dtype": "dtype", "--quantization": "quantization", "--kv-cache-dtype": "kv_cache_dtype"}
    return {names[flag]: value for flag, value in zip(flags[::2], flags[1::2], strict=True)}


def time_engine(engine: Any, specs: list[RequestSpec], threads: int) -> dict[str, Any]:
    """Each prompt alone, as one served stream sends it: TTFT (a 1-token run) and the whole request."""
    torch.set_num_threads(threads)
    ttfts, tpots, totals, tokens = [], [], [], 0
    for spec in specs:
        prompt, new = spec.body["prompt"], spec.body["max_tokens"]
        engine.pool.reset_prefix_cache()
        t0 = time.perf_counter()
        engine.generate([prompt], _greedy(1))
        ttft = time.perf_counter() - t0
        engine.pool.reset_prefix_cache()
        t0 = time.perf_counter()
        (result,) = engine.generate([prompt], _greedy(new))
        total = time.perf_counter() - t0
        assert len(result.token_ids) == new, len(result.token_ids)
        ttfts.append(ttft)
        totals.append(total)
        tpots.append((total - ttft) / (new - 1))
        tokens += new
    point = {"threads": threads, "output_tok_s": tokens / sum(totals),
             "p50_ttft_ms": statistics.median(ttfts) * 1e3, "p50_tpot_ms": statistics.median(tpots) * 1e3}
    logger.info("engine, %d thread(s): %.1f tok/s, TTFT %.0f ms, TPOT %.1f ms", threads, point["output_tok_s"],
                point["p50_ttft_ms"], point["p50_tpot_ms"])
    return point


def time_served(system: str, config: ServerConfig, ids: list[int], specs: list[RequestSpec],
                timeout_s: float) -> dict[str, Any]:
    with Server(system, config) as server:
        asyncio.run(warm_up(server.base_url, MODEL_NAME, ids, adapt=server.adapt))
        point = run_point(server, specs, "c=1", concurrency=1, timeout_s=timeout_s)
    return {k: point[k] for k in ("output_tok_s", "p50_ttft_ms", "p50_tpot_ms", "num_failed", "requests")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="float32", choices=sorted(PRECISION_FLAGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3, help="prompts per system per round")
    parser.add_argument("--quick", action="store_true", help="64 in / 16 out, one round, two requests")
    parser.add_argument("--port", type=int, default=18100)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/baton/bench-serve")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)

    args.work_dir.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(work_dir=args.work_dir, hf_dir=export_hf(args.work_dir),
                          vllm_venv=Path.home() / ".cache/baton/peers/vllm-venv", port=args.port)
    ids = vocab_ids(config.hf_dir)
    shape = (64, 16) if args.quick else (256, 128)
    rounds, requests = (1, 2) if args.quick else (args.rounds, args.requests)
    specs = random_token_set(requests, *shape, ids, seed=1)
    cores = torch.get_num_threads()
    logger.info("measuring the machine ...")
    result: dict[str, Any] = {"bench": "serve_overhead", "model": MODEL_NAME, "precision": args.precision,
                              "quick": args.quick, "input_len": shape[0], "output_len": shape[1],
                              "requests": requests, "machine": machine_info(config.vllm_venv), "env": BATON_ENV,
                              "rounds": []}
    logger.info("loading the engine in-process (%s) ...", args.precision)
    engine = LLMEngine(EngineConfig(model=MODEL_NAME, max_model_len=2048, **engine_config(args.precision)))
    engine.generate([specs[0].body["prompt"][:32]], _greedy(4))  # warm-up: first-call costs stay out
    suffix = "" if args.precision == "float32" else f"@{args.precision}"
    started = time.monotonic()
    for r in range(rounds):
        logger.info("round %d/%d", r + 1, rounds)
        row: dict[str, Any] = {"engine": time_engine(engine, specs, cores), "engine_1_thread": time_engine(engine, specs, 1)}
        torch.set_num_threads(cores)
        for name, system in (("colocated", f"baton-colocated{suffix}"), ("disaggregated", f"baton{suffix}")):
            logger.info("starting %s ...", system)
            row[name] = time_served(system, config, ids, specs, timeout_s=240.0)
            row[name]["served_over_engine"] = row[name]["output_tok_s"] / row["engine"]["output_tok_s"]
            logger.info("%s: %.1f tok/s, %.2f of the engine's", name, row[name]["output_tok_s"],
                        row[name]["served_over_engine"])
        result["rounds"].append(row)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["summary"] = {name: statistics.median(row[name]["served_over_engine"] for row in result["rounds"])
                         for name in ("colocated", "disaggregated")}
    path = write_results(result, args.out, "serve_overhead", record_name=True)
    logger.info("wrote %s", path)
    print(json.dumps({"bench": "serve_overhead", "file": path.name, "commit": result["machine"]["commit"],
                      "precision": args.precision, "served_over_engine": result["summary"],
                      "tok_s": [{k: round(row[k]["output_tok_s"], 1) for k in
                                 ("engine", "engine_1_thread", "colocated", "disaggregated")}
                                for row in result["rounds"]]}))
    return 0


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


if __name__ == "__main__":
    sys.exit(main())
