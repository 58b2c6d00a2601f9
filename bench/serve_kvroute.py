"""Routing policies on a multi-turn workload with shared prefixes: round-robin, least-loaded, KV-aware.

    for round in 1..R (policy order reversed every other round, so drift on this shared machine
    hits every policy alike):
        for policy in --policies:
            `baton up --prefill P --decode D` with BATON_ROUTER_ROUTING_POLICY=policy ─► warm up
            ─► for rate in rates: multi-turn conversations (bench/serve_multiturn.py) ─► router /metrics
            ─► stop
    ─► JSON in bench/results/serve_kvroute-*.json (last stdout line: the summary)

Per policy and rate: prefix hit rate (cached prompt tokens over prompt tokens, from each response's
usage), TTFT and TPOT p50/p99, SLO attainment and goodput at that rate (requests meeting the SLO per
second), and the router's calls per instance. Over the rates: goodput as DistServe defines it (the
highest rate with >= 90% attainment, bench/serve_stats.py). Ratios are against round_robin, round by
round. `kv-local` is the KV policy with local prefill at the cost model's break-even length.

`--pool-bound`: more shared templates (16 of 300 words, drawn at random per conversation) than
kv_transfer's pool (192 MiB, about 7 of them) or any engine's own cache (256 MiB, about 9) holds, so
prefixes are evicted and routing decides which instance still has one: a policy that keeps each template
on one prefill instance lets the two caches hold half the templates each, where spreading them makes
both churn through all 16. Its first version (12 templates of 600 words, 16 conversations, template
c % 12) reused a template in at most 4 first turns, so routing could move only a few percent of the
prompt tokens (serve_kvroute-20261126-210410.json: 63-66% hits for every policy).

    .venv/bin/python -m bench.serve_kvroute [--quick | --heavy | --pool-bound | --burst]
                                            [--policies round_robin,least_loaded,kv,kv-local,kv-no-memory]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.results_file import write_results
from bench.serve_load import warm_up
from bench.serve_machine import machine_info
from bench.serve_multiturn import MultiTurnPlan, conversations, run_conversations, summarize_turns
from bench.serve_report import write_block
from bench.serve_stats import SLO, goodput
from bench.serve_systems import BATON_ENV, MODEL_NAME, Server, ServerConfig, export_hf

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.serve_kvroute")

POLICIES: dict[str, dict[str, str]] = {
    "round_robin": {"BATON_ROUTER_ROUTING_POLICY": "round_robin"},
    "least_loaded": {"BATON_ROUTER_ROUTING_POLICY": "least_loaded"},
    "kv": {"BATON_ROUTER_ROUTING_POLICY": "kv"},
    "kv-local": {"BATON_ROUTER_ROUTING_POLICY": "kv", "BATON_ROUTER_LOCAL_PREFILL_MAX_TOKENS": "-1"},
    # the KV policy reading the instances' reports only, without its memory of what it sent where
    "kv-no-memory": {"BATON_ROUTER_ROUTING_POLICY": "kv", "BATON_ROUTER_ROUTED_PREFIX_TTL_S": "0"},
}


def plan(quick: bool, heavy: bool = False, pool_bound: bool = False, burst: bool = False) -> dict[str, Any]:
    """Workload, rates and rounds; --quick shrinks everything to a smoke test, --heavy takes long shared
    templates (8 of 600 words) through the machine's knee (0.2 conv/s was past it for every policy in
    serve_kvroute-20261126-101545.json, which ran 0.2-0.8); --pool-bound bounds the caches below the
    templates (SmolLM2 fp32: ~46 KiB of KV a token, ~37 MiB a 600-word template); --burst sends the first
    turns of a few templates within seconds of each other, faster than the instances report what they
    hold."""
    if burst:
        workload = MultiTurnPlan(num_conversations=16, num_turns=1, num_templates=4, template_words=300,
                                 user_words=24, output_tokens=16)
        return {"workload": asdict(workload), "rates": [2.0, 4.0], "rounds": 2, "timeout_s": 300.0,
                "prefill": 2, "decode": 1}
    if pool_bound:
        workload = MultiTurnPlan(num_conversations=40, num_turns=2, num_templates=16, template_words=300,
                                 user_words=24, output_tokens=32, random_templates=True)
        return {"workload": asdict(workload), "rates": [0.2, 0.4], "rounds": 1, "timeout_s": 420.0,
                "prefill": 2, "decode": 2, "kv_transfer_capacity_bytes": 192 << 20, "kv_cache_bytes": 256 << 20}
    if heavy:
        workload = MultiTurnPlan(num_conversations=16, num_turns=4, num_templates=8, template_words=600,
                                 user_words=24, output_tokens=32)
        return {"workload": asdict(workload), "rates": [0.05, 0.1, 0.2], "rounds": 1, "timeout_s": 420.0,
                "prefill": 2, "decode": 2}
    if quick:
        workload = MultiTurnPlan(num_conversations=4, num_turns=2, num_templates=2, template_words=40,
                                 user_words=8, output_tokens=8)
        return {"workload": asdict(workload), "rates": [0.5], "rounds": 1, "timeout_s": 180.0,
                "prefill": 1, "decode": 2}
    workload = MultiTurnPlan(num_conversations=16, num_turns=4, num_templates=4, template_words=150,
                             user_words=24, output_tokens=32)
    return {"workload": asdict(workload), "rates": [0.05, 0.1, 0.2], "rounds": 2, "timeout_s": 420.0,
            "prefill": 2, "decode": 2}


def router_assignments(base_url: str) -> dict[str, Any]:
    """The router's calls per (role, instance) and its local prefills, from its /metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    calls = {f"{role}/{inst}": float(v) for inst, role, v in re.findall(
        r'^baton_router_assignments_total\{instance="([^"]*)",role="([^"]*)"\} (\S+)$', text, re.M)}
    local = re.search(r"^baton_router_local_prefills_total (\S+)$", text, re.M)
    return {"calls": calls, "local_prefills": float(local.group(1)) if local else 0.0}


def bench_policy(server: Server, ids: list[int], p: dict[str, Any], slo: SLO, seed: int) -> dict[str, Any]:
    asyncio.run(warm_up(server.base_url, MODEL_NAME, ids))
    out: dict[str, Any] = {"ready_after_s": round(server.ready_after_s, 1), "rates": []}
    for i, rate in enumerate(p["rates"]):
        # fresh templates and conversations at each rate: the rates before it must not have warmed its prefixes
        convs = conversations(MultiTurnPlan(**p["workload"]), seed + 1000 * i)
        before = router_assignments(server.base_url)
        turns, duration_s = asyncio.run(run_conversations(
            server.base_url, MODEL_NAME, convs, p["workload"]["output_tokens"], rate=rate, seed=seed,
            timeout_s=p["timeout_s"]))
        after = router_assignments(server.base_url)
        point = {"rate": rate, **summarize_turns(turns, duration_s, slo),
                 "calls": {k: v - before["calls"].get(k, 0.0) for k, v in after["calls"].items()},
                 "local_prefills": after["local_prefills"] - before["local_prefills"]}
        logger.info("%s rate=%.2f: hit rate %.2f, p50/p99 TTFT %.0f/%.0f ms, attainment %.2f, %d failed",
                    server.name, rate, point["prefix_hit_rate"], point["p50_ttft_ms"], point["p99_ttft_ms"],
                    point["slo_attainment"], point["num_failed"])
        out["rates"].append(point)
    out["goodput"] = vars(goodput({pt["rate"]: pt["slo_attainment"] for pt in out["rates"]}))
    return out


def aggregate(runs: list[dict[str, Any]], baseline: str = "round_robin") -> dict[str, Any]:
    """Per policy: medians over rounds of each rate's figures; ratios to the baseline of the same round."""
    figures = ("prefix_hit_rate", "prefix_hit_rate_first_turns", "p50_ttft_ms", "p99_ttft_ms", "slo_attainment",
               "good_req_s")
    out: dict[str, Any] = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = [r for r in runs if r["policy"] == policy and "rates" in r]
        if not mine:
            continue
        per_rate = {}
        for i, point in enumerate(mine[0]["rates"]):
            entry: dict[str, Any] = {f: statistics.median(r["rates"][i].get(f, float("nan")) for r in mine)
                                     for f in figures}
            ratios = [r["rates"][i]["p99_ttft_ms"] / b["rates"][i]["p99_ttft_ms"] for r in mine for b in runs
                      if b["policy"] == baseline and b["round"] == r["round"] and "rates" in b]
            if ratios and policy != baseline:
                entry["p99_ttft_ratio_to_baseline"] = {"median": statistics.median(ratios),
                                                       "min": min(ratios), "max": max(ratios)}
            per_rate[str(point["rate"])] = entry
        out[policy] = {"rates": per_rate,
                       "goodput_req_s": statistics.median(r["goodput"]["interpolated_rate"] for r in mine)}
    return out


def readme_table(result: dict[str, Any]) -> str:
    """The README block: per policy and rate, the medians over rounds (generated, never typed)."""
    p = result["plan"]
    failed = [f"{r['policy']} round {r['round'] + 1} ({r['error'][:80]})" for r in result["runs"] if "error" in r]
    lines = [f"Routing policies on a multi-turn workload with shared prefixes (`bench/serve_kvroute.py`, "
             f"`{result['file']}`: {p['workload']['num_conversations']} conversations x "
             f"{p['workload']['num_turns']} turns on {p['workload']['num_templates']} shared templates of "
             f"{p['workload']['template_words']} words, {p['prefill']} prefill + {p['decode']} decode, medians over "
             f"the rounds that ran of {p['rounds']} alternating ones"
             + (f"; kv_transfer's pool {p['kv_transfer_capacity_bytes'] >> 20} MiB and each engine's cache "
                f"{p['kv_cache_bytes'] >> 20} MiB, below the templates" if "kv_cache_bytes" in p else "")
             + f"; SLO TTFT {result['slo']['ttft_ms']:.0f} ms, "
             f"TPOT {result['slo']['tpot_ms']:.0f} ms)" + (f"; failed to run: {'; '.join(failed)}" if failed else "")
             + ":", "",
             "| policy | rounds | rate (conv/s) | prefix hit rate | first turns' | p50 TTFT ms | p99 TTFT ms | p99 TTFT / round_robin "
             "| SLO attainment | good req/s | goodput (req/s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for policy, s in result["summary"].items():
        rounds = sum(1 for r in result["runs"] if r["policy"] == policy and "rates" in r)
        for rate, e in s["rates"].items():
            ratio = e.get("p99_ttft_ratio_to_baseline")
            ratio_text = f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "-"
            lines.append(f"| {policy} | {rounds} | {rate} | {e['prefix_hit_rate']:.1%} | "
                         f"{e['prefix_hit_rate_first_turns']:.1%} | {e['p50_ttft_ms']:.0f} | "
                         f"{e['p99_ttft_ms']:.0f} | {ratio_text} | {e['slo_attainment']:.2f} | "
                         f"{e['good_req_s']:.2f} | {s['goodput_req_s']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated of {list(POLICIES)}")
    parser.add_argument("--quick", action="store_true", help="tiny loads: a smoke test of the whole pipeline")
    parser.add_argument("--heavy", action="store_true", help="long templates, rates through the machine's knee")
    parser.add_argument("--pool-bound", action="store_true", help="more templates than the pool and caches hold")
    parser.add_argument("--burst", action="store_true", help="templates' first turns faster than KV reports")
    parser.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/baton/bench-kvroute")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite bench/README.md's table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {list(POLICIES)}")

    args.work_dir.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(work_dir=args.work_dir, hf_dir=export_hf(args.work_dir), port=args.port,
                          vllm_venv=Path("/nonexistent"))
    from bench.serve import vocab_ids

    ids = vocab_ids(config.hf_dir)
    p = plan(args.quick, args.heavy, args.pool_bound, args.burst)
    slo = SLO(ttft_s=args.ttft_slo_ms / 1e3, tpot_s=args.tpot_slo_ms / 1e3)
    result: dict[str, Any] = {"bench": "serve_kvroute", "model": MODEL_NAME, "quick": args.quick,
                              "heavy": args.heavy, "pool_bound": args.pool_bound, "burst": args.burst, "plan": p,
                              "machine": machine_info(Path("/nonexistent")), "env": BATON_ENV, "policies": POLICIES,
                              "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms, "attainment": 0.9},
                              "runs": []}
    started = time.monotonic()
    up_args: tuple[str, ...] = ("--prefill", str(p["prefill"]), "--decode", str(p["decode"]))
    for flag in ("kv_cache_bytes", "kv_transfer_capacity_bytes"):  # `baton up`'s own flags: it sets its
        if flag in p:  # children's environment from them, over anything inherited
            up_args += (f"--{flag.replace('_', '-')}", str(p[flag]))
    for rnd in range(p["rounds"]):
        for policy in policies if rnd % 2 == 0 else list(reversed(policies)):
            logger.info("round %d/%d: %s ...", rnd + 1, p["rounds"], policy)
            run: dict[str, Any] = {"policy": policy, "round": rnd}
            try:
                with Server("baton", config, up_args=up_args, env=POLICIES[policy], name=f"kvroute-{policy}") as srv:
                    run.update(bench_policy(srv, ids, p, slo, args.seed))
            except (RuntimeError, TimeoutError) as exc:
                logger.error("%s failed: %s", policy, exc)
                run["error"] = str(exc)
            result["runs"].append(run)
    result["summary"] = aggregate(result["runs"])
    result["wall_s"] = round(time.monotonic() - started, 1)
    path = write_results(result, args.out, "serve_kvroute", indent=None, record_name=True)
    logger.info("wrote %s", path)
    if not args.quick and not args.no_readme:
        block = "serve_kvroute_burst" if args.burst else "serve_kvroute_pool_bound" if args.pool_bound \
            else "serve_kvroute_heavy" if args.heavy else "serve_kvroute"
        write_block(Path(__file__).parent / "README.md", block, readme_table(result))
    print(json.dumps({"bench": "serve_kvroute", "file": path.name, "commit": result["machine"]["commit"],
                      "summary": result["summary"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
