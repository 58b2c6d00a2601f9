"""Serving benchmark: baton against vLLM's CPU build, same client, same prompts, same run.

    for each system in --systems:
        start it (bench/serve_systems.py) ─► warm up ─► concurrency sweep ─► rate sweep ─► chat set ─► stop
    ─► JSON in bench/results/serve-*.json, a PNG plot, the table in bench/README.md
    (last stdout line: the JSON summary)

Concurrency sweep: random-token prompts, 256 in / 128 out (ignore_eos), at
1, 8 and 32 requests in flight. Rate sweep: the same shape with Poisson
arrivals. Chat set: real questions through the chat template, 8 in flight.
Each system's goodput over the rate sweep is reported against the SLO given.
`--goodput` also runs the disaggregation experiment (bench/serve_goodput.py).

    .venv/bin/python -m bench.serve --systems baton,vllm [--goodput] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.serve_goodput import run_experiment
from bench.serve_load import chat_set, random_token_set, warm_up
from bench.serve_machine import machine_info
from bench.serve_point import run_point
from bench.serve_stats import SLO, goodput
from bench.serve_systems import BATON_ENV, MODEL_NAME, VLLM_ENV, Server, ServerConfig, export_hf

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.serve")


def vocab_ids(hf_dir: Path) -> list[int]:
    """Token ids a random prompt may use: the whole vocabulary but special and added tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    special = set(tok.all_special_ids) | {int(i) for i in getattr(tok, "added_tokens_decoder", {})}
    return [i for i in range(len(tok)) if i not in special]


def plan(quick: bool, concurrency_only: bool = False) -> dict[str, Any]:
    """Load levels and request counts; --quick shrinks everything to a smoke test, --concurrency-only drops
    the rate sweep and the chat set (a precision comparison: minutes per system, not ten)."""
    if quick:
        p = {"input_len": 64, "output_len": 16, "concurrency": [(1, 2), (8, 8)], "rates": [(1.0, 6)],
             "chat": (4, 16), "timeout_s": 120.0}
    else:
        # (level, requests): about a minute of work each at ~40 tok/s, the machine's measured range
        p = {"input_len": 256, "output_len": 128, "concurrency": [(1, 3), (8, 16), (32, 32)],
             "rates": [(0.1, 6), (0.2, 8), (0.3, 12), (0.45, 18), (0.65, 24)], "chat": (8, 128),
             "timeout_s": 240.0}
    if concurrency_only:
        p.update(rates=[], chat=None)
    return p


def bench_system(server: Server, ids: list[int], p: dict[str, Any], slo: SLO, seed: int) -> dict[str, Any]:
    asyncio.run(warm_up(server.base_url, MODEL_NAME, ids, adapt=server.adapt))
    shape = (p["input_len"], p["output_len"])
    out: dict[str, Any] = {"system": server.system, "ready_after_s": round(server.ready_after_s, 1),
                           "concurrency": [], "rates": []}
    for conc, n in p["concurrency"]:
        specs = random_token_set(n, *shape, ids, seed=seed + conc)
        out["concurrency"].append(run_point(server, specs, f"c={conc}", concurrency=conc,
                                            timeout_s=p["timeout_s"], slo=slo))
    for rate, n in p["rates"]:
        specs = random_token_set(n, *shape, ids, seed=seed + 1000 + int(rate * 100))
        out["rates"].append(run_point(server, specs, f"rate={rate}", rate=rate, seed=seed,
                                      timeout_s=p["timeout_s"], slo=slo))
    if p["chat"] is None:  # --concurrency-only
        return out
    att = {pt["rate"]: pt["slo_attainment"] for pt in out["rates"]}
    out["goodput"] = vars(goodput(att))
    num_chat, max_tokens = p["chat"]
    out["chat"] = run_point(server, chat_set(num_chat, max_tokens, seed=seed), "chat c=8", concurrency=8,
                            timeout_s=p["timeout_s"], slo=slo)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="baton,vllm", help="comma-separated; see bench/serve_systems.py")
    parser.add_argument("--goodput", action="store_true", help="also run the colocated/disaggregated experiment")
    parser.add_argument("--goodput-only", action="store_true", help="only the disaggregation experiment")
    parser.add_argument("--quick", action="store_true", help="tiny loads: a smoke test of the whole pipeline")
    parser.add_argument("--concurrency-only", action="store_true",
                        help="only the concurrency sweep (README block serve:precisions); systems may name a "
                             "precision: baton-colocated@bfloat16, baton@int8, baton@gguf")
    parser.add_argument("--ttft-slo-ms", type=float, default=3000.0, help="SLO for the comparison sweep")
    parser.add_argument("--tpot-slo-ms", type=float, default=200.0, help="SLO for the comparison sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18100)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/baton/bench-serve")
    parser.add_argument("--vllm-venv", type=Path, default=Path.home() / ".cache/baton/peers/vllm-venv")
    parser.add_argument("--llamacpp-venv", type=Path, default=Path.home() / ".cache/baton/peers/llamacpp-venv")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite bench/README.md's table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)

    args.work_dir.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(work_dir=args.work_dir, hf_dir=export_hf(args.work_dir), vllm_venv=args.vllm_venv,
                          llamacpp_venv=args.llamacpp_venv, port=args.port)
    ids = vocab_ids(config.hf_dir)
    p = plan(args.quick, args.concurrency_only)
    slo = SLO(ttft_s=args.ttft_slo_ms / 1e3, tpot_s=args.tpot_slo_ms / 1e3)
    logger.info("measuring the machine ...")
    result: dict[str, Any] = {"bench": "serve", "model": MODEL_NAME, "quick": args.quick,
                              "concurrency_only": args.concurrency_only,
                              "machine": machine_info(args.vllm_venv, args.llamacpp_venv), "plan": p,
                              "env": {"baton": BATON_ENV, "vllm": VLLM_ENV},
                              "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms,
                                      "attainment": 0.9}, "systems": []}
    started = time.monotonic()
    if not args.goodput_only:
        for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
            logger.info("starting %s ...", system)
            try:
                with Server(system, config) as server:
                    result["systems"].append(bench_system(server, ids, p, slo, args.seed))
            except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
                logger.error("%s failed: %s", system, exc)
                result["systems"].append({"system": system, "error": str(exc)})
    if args.goodput or args.goodput_only:
        result["goodput_experiment"] = run_experiment(config, ids, args.quick, args.seed)
    result["wall_s"] = round(time.monotonic() - started, 1)
    write_outputs(result, args.out, readme=not args.no_readme)
    print(json.dumps(headline(result)))
    return 0


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The one-line summary: per system, output tok/s and p99 TPOT at each concurrency; goodputs."""
    line: dict[str, Any] = {"bench": "serve", "file": result.get("file"), "commit": result["machine"]["commit"]}
    for s in result["systems"]:
        line[s["system"]] = {pt["label"]: [round(pt["output_tok_s"], 1), round(pt["p99_tpot_ms"], 1)]
                             for pt in s.get("concurrency", [])} or s.get("error")
    if "goodput_experiment" in result:
        g = result["goodput_experiment"]
        line["goodput_req_s"] = {k: v["goodput"]["interpolated_rate"] for k, v in g["systems"].items()}
        line["goodput_ratio"] = g.get("ratio")
    return line


def write_outputs(result: dict[str, Any], out_dir: Path, readme: bool) -> None:
    from bench.serve_report import plot, update_readme

    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"serve-{stamp}.json"
    result["file"] = path.name
    png = out_dir / f"serve-{stamp}.png"
    if plot(result, png):
        result["plot"] = png.name
    path.write_text(json.dumps(result, separators=(",", ":")))
    logger.info("wrote %s", path)
    if readme and not result["quick"]:
        update_readme(result, Path(__file__).parent / "README.md")


if __name__ == "__main__":
    sys.exit(main())
