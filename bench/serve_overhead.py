"""The serving overhead: one stream served against the same engine in-process, same prompts, same run.

    load the engine in-process; then for each stack (`baton up --mode colocated`, `baton up`, `baton up
    --no-core-share`): start it, and for each round (--rounds) and prompt (--requests), one request each:
        engine (all cores' threads) ─► engine (one thread) ─► the stack
    ─► JSON in bench/results/serve_overhead-*.json (last stdout line: the summary)

Every system decodes the same random-token prompts (256 ids in, exactly 128 out, greedy, one request at a
time), and every figure is output tokens over the wall time of the requests, prefill included, as
`bench/serve.py` counts its c=1 point. The in-process engine gets each prompt with an empty prefix cache,
like a served random prompt. The engine and the stack take turns request by request (the stack idle while
the engine runs, and the reverse), because this machine's memory bandwidth drifts by a fifth within a
minute: a first version that timed each system for a whole round in turn read the same code at 0.72x and
1.09x in two rounds, and one that kept all three stacks up at once charged the served figures for the two
idle stacks' background work on the core the router and client need. `served / engine` is the issue's
ratio (target >= 0.9), per round against the engine runs of that round, and its median over rounds. The
one-thread engine is recorded beside it (each disaggregated engine's share of two cores), and the
disaggregated stack with its engines on fixed shares (`--no-core-share`, shared/engine/core_share.py) is
the same run's baseline for lending cores. TTFT and TPOT (p50) come with each figure, so a gap can be
placed in prefill or in the decode loop.

    .venv/bin/python -m bench.serve_overhead [--precision float32|bfloat16|int8|...] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results
from bench.serve import vocab_ids
from bench.serve_load import RequestSpec, random_token_set, run_load, warm_up
from bench.serve_machine import machine_info
from bench.serve_report import write_block
from bench.serve_systems import (
    BATON_ENV,
    MODEL_NAME,
    PRECISION_FLAGS,
    STREAM_INTERVAL_MARK,
    Server,
    ServerConfig,
    export_hf,
)
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.service.gc_heap import freeze_startup_heap

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.serve")


def engine_config(precision: str) -> dict[str, Any]:
    """`baton up`'s precision flags (bench/serve_systems.py) as EngineConfig fields, so both run one setting."""
    flags = PRECISION_FLAGS[precision]
    names = {"--dtype": "dtype", "--quantization": "quantization", "--kv-cache-dtype": "kv_cache_dtype"}
    return {names[flag]: value for flag, value in zip(flags[::2], flags[1::2], strict=True)}


def time_engine(engine: LLMEngine, spec: RequestSpec, threads: int) -> list[float]:
    """One prompt alone, as one served stream sends it: [ttft_ms, tpot_ms, tokens, seconds]."""
    torch.set_num_threads(threads)
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
    return [ttft * 1e3, (total - ttft) / (new - 1) * 1e3, new, total]


def time_served(server: Server, spec: RequestSpec, timeout_s: float, cpu: dict[str, float]) -> list[float]:
    """One request through the stack's HTTP API: [ttft_ms, tpot_ms, tokens, seconds] (client included).

    Adds the CPU seconds each of the stack's services and this client spent on it to `cpu`: what the
    served request costs besides the model, on the same cores the model computes on.
    """
    before = _cpu_seconds(server)
    (record,), duration_s = asyncio.run(run_load(server.base_url, MODEL_NAME, [spec], concurrency=1,
                                                 timeout_s=timeout_s))
    for name, seconds in _cpu_seconds(server).items():
        cpu[name] = cpu.get(name, 0.0) + seconds - before.get(name, seconds)
    if not record.ok:
        raise RuntimeError(f"{server.system}: request failed: {record.error}")
    return [record.ttft_s * 1e3, record.tpot_s * 1e3, record.output_tokens, duration_s]


def _cpu_seconds(server: Server) -> dict[str, float]:
    """User + system CPU seconds of each service of the stack (its stack.json) and of this process."""
    out = {"client": sum(os.times()[:2])}
    stack = server.log_dir / "state" / "stack.json"
    tick = os.sysconf("SC_CLK_TCK")
    for service in json.loads(stack.read_text())["services"] if stack.exists() else []:
        try:
            fields = Path(f"/proc/{service['pid']}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, KeyError):
            continue
        out[service["name"]] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def summarize(runs: list[list[float]]) -> dict[str, Any]:
    """A system's requests of one round: output tok/s over their summed wall time, p50 TTFT and TPOT."""
    return {"output_tok_s": sum(r[2] for r in runs) / sum(r[3] for r in runs),
            "p50_ttft_ms": statistics.median(r[0] for r in runs), "p50_tpot_ms": statistics.median(r[1] for r in runs),
            "requests": [[round(x, 2) for x in r] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="float32", choices=sorted(PRECISION_FLAGS))
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the stacks' --stream-interval (tokens per streamed message; the engine's are its own)")
    parser.add_argument("--rounds", type=int, default=3)
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
    cores = torch.get_num_threads()
    logger.info("measuring the machine ...")
    result: dict[str, Any] = {"bench": "serve_overhead", "model": MODEL_NAME, "precision": args.precision,
                              "stream_interval": args.stream_interval,
                              "quick": args.quick, "input_len": shape[0], "output_len": shape[1],
                              "requests": requests, "machine": machine_info(config.vllm_venv), "env": BATON_ENV,
                              "stacks": {}}
    suffix = ("" if args.precision == "float32" else f"@{args.precision}") + \
        ("" if args.stream_interval == 1 else f"{STREAM_INTERVAL_MARK}{args.stream_interval}")
    stacks = {"colocated": Server(f"baton-colocated{suffix}", config),
              "disaggregated": Server(f"baton{suffix}", config),
              # the same stack with each engine on its fixed share of the cores (before core sharing)
              "disaggregated_fixed_shares": Server(f"baton{suffix}", config, up_args=("--no-core-share",),
                                                   name="baton-fixed-shares")}
    logger.info("loading the engine in-process (%s) ...", args.precision)
    engine = LLMEngine(EngineConfig(model=MODEL_NAME, max_model_len=2048, **engine_config(args.precision)))
    engine.generate([[7] * 32], _greedy(4))  # warm-up: first-call costs stay out
    freeze_startup_heap()  # as the services do once started: the in-process engine is timed like them
    started = time.monotonic()
    for s_index, (name, server) in enumerate(stacks.items()):
        logger.info("starting %s (%s) ...", name, server.system)
        rows = []
        with server:
            asyncio.run(warm_up(server.base_url, MODEL_NAME, ids, adapt=server.adapt))
            for r in range(rounds):
                # fresh prompts every round: a stack keeps the last round's in its prefix cache (the engine's
                # is emptied before each request)
                specs = random_token_set(requests, *shape, ids, seed=100 * s_index + r)
                runs: dict[str, list[list[float]]] = {"engine": [], "engine_1_thread": [], "served": []}
                cpu: dict[str, float] = {}
                for i, spec in enumerate(specs):
                    logger.info("%s: round %d/%d, prompt %d/%d", name, r + 1, rounds, i + 1, requests)
                    runs["engine"].append(time_engine(engine, spec, cores))
                    runs["engine_1_thread"].append(time_engine(engine, spec, 1))
                    torch.set_num_threads(cores)
                    runs["served"].append(time_served(server, spec, timeout_s=240.0, cpu=cpu))
                row = {k: summarize(rs) for k, rs in runs.items()}
                tokens = sum(r[2] for r in runs["served"])
                row["cpu_ms_per_token"] = {k: round(v / tokens * 1e3, 3) for k, v in sorted(cpu.items())}
                row["served_over_engine"] = row["served"]["output_tok_s"] / row["engine"]["output_tok_s"]
                logger.info("%s, round %d: %s; served / engine %.2f; CPU ms a token %s", name, r + 1, ", ".join(
                    f"{k} {p['output_tok_s']:.1f} tok/s (TTFT {p['p50_ttft_ms']:.0f} ms, TPOT {p['p50_tpot_ms']:.1f})"
                    for k, p in row.items() if k in runs), row["served_over_engine"], row["cpu_ms_per_token"])
                rows.append(row)
        result["stacks"][name] = {"system": server.system, "up_args": list(server.up_args), "rounds": rows,
                                  "served_over_engine": statistics.median(row["served_over_engine"] for row in rows)}
    result["wall_s"] = round(time.monotonic() - started, 1)
    path = write_results(result, args.out, "serve_overhead", record_name=True)
    logger.info("wrote %s", path)
    if not args.quick and args.out == RESULTS:
        write_block(Path(__file__).parent / "README.md", "serve:overhead", readme_table(RESULTS))
    print(json.dumps({"bench": "serve_overhead", "file": path.name, "commit": result["machine"]["commit"],
                      "precision": args.precision, "stream_interval": args.stream_interval,
                      **{name: {"served_over_engine": round(st["served_over_engine"], 3),
                                "tok_s": [[round(row[k]["output_tok_s"], 1) for k in ("engine", "served")]
                                          for row in st["rounds"]]}
                         for name, st in result["stacks"].items()}}))
    return 0


def readme_table(results: Path) -> str:
    """Markdown: the latest full run of each precision and stream interval, one row per stack (bench/README.md's
    serve:overhead)."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for path in sorted(results.glob("serve_overhead-*.json")):
        run = json.loads(path.read_text())
        if "stacks" in run and not run["quick"]:  # the first design kept no per-stack rounds
            latest[run["precision"], run.get("stream_interval", 1)] = run
    lines = ["One stream (256 in / 128 out, greedy), served against the same engine in-process, request by "
             "request in turn; tok/s are medians over rounds, the ratio the median of per-round ratios:", "",
             "| precision | stack | run | CPU (kernels' ISA) | engine tok/s | served tok/s | served / engine (rounds) | TTFT engine / "
             "served (ms) | TPOT engine / served (ms) | CPU a token: router / client (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (precision, interval), run in sorted(latest.items()):
        setting = precision if interval == 1 else f"{precision}, stream interval {interval}"
        for name, stack in run["stacks"].items():
            rows = stack["rounds"]

            def med(system: str, key: str, rows: list[dict[str, Any]] = rows) -> float:
                return statistics.median(row[system][key] for row in rows)

            ratios = " ".join(f"{r['served_over_engine']:.2f}" for r in rows)
            cpu = [statistics.median(r.get("cpu_ms_per_token", {}).get(k, float("nan")) for r in rows)
                   for k in ("router", "client")]
            lines.append(
                f"| {setting} | {name} | `{run['file']}` (`{run['machine']['commit']}`) | {_cpu(run['machine'])} | "
                f"{med('engine', 'output_tok_s'):.1f} | {med('served', 'output_tok_s'):.1f} | "
                f"**{stack['served_over_engine']:.2f}** ({ratios}) | "
                f"{med('engine', 'p50_ttft_ms'):.0f} / {med('served', 'p50_ttft_ms'):.0f} | "
                f"{med('engine', 'p50_tpot_ms'):.1f} / {med('served', 'p50_tpot_ms'):.1f} | "
                f"{cpu[0]:.2f} / {cpu[1]:.2f} |")
    return "\n".join(lines)


def _cpu(machine: dict[str, Any]) -> str:
    """The CPU a run had, with the kernels' level where the run recorded it (from 2026-12-07: before, the
    model name alone, which for 'AMD EPYC' does not tell an AVX2-only Zen 3 from a Zen 5)."""
    return f"{machine['cpu_model']} ({machine['isa']})" if "isa" in machine else machine["cpu_model"]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


if __name__ == "__main__":
    sys.exit(main())
