"""Does `baton plan`'s simulator predict real runs? Predicted against measured, on real `baton up` stacks.

    profile (`baton profile`, or --profile P taken on this machine's shape)
    for shape in colocated, 1P1D, 1P2D, 2P1D:
        `baton up` of that shape ─► warm up ─► for rate in rates:
            one fixed-seed trace (the chat workload, lengths capped for 2 cores) sent at its own arrival
            times as exact-length completions ─► measured TTFT / TPOT p50, p99, attainment, goodput
            the same trace through the simulator (this host's cores shared and lent between engines as
            `baton up` does, the router's kv policy) ─► predicted; and with fixed shares, for comparison
    ─► JSON in bench/results/plan_validate-*.json, a table (and a plot with matplotlib) for bench/README.md

The error of each figure is (predicted − measured) / measured. Two further predictions are reported beside
the plain one, never instead of it:
  probed (probe_stack(), every run): before and after each rate's trace, the stack serves a few probe
      requests alone (fresh prompts of two lengths, none of them the trace's); the served TTFT against the
      simulator's for the same requests gives a fixed serving overhead (HTTP, tokenization, gRPC, the
      stream's first hop: the simulator's `router_overhead_s`) and the machine's prefill speed then against
      the profile's; their TPOT its decode speed. The trace is predicted with the mean of the two probes
      (bracketed(): the machine's speed moves by a fifth or more within a trace's minute or two), and, in
      `figures_probed_before`, with the probe before it alone, as runs before 2026-11-29 13:00 were. Every
      trace point stays held out.
  calibrated (`--calibrate`, calibrated()): each shape's prefill and decode curves scaled to what its lowest
      rate measured, the other rates held out.

    .venv/bin/python -m bench.plan_validate [--quick] [--profile P] [--shapes colocated,1P1D,1P2D,2P1D]
                                            [--rates 0.25,0.5,1.0] [--requests 20] [--calibrate]
                                            [--quick-profile]
    .venv/bin/python -m bench.plan_validate --resimulate bench/results/plan_validate-<stamp>.json
        (that run's measurements against the simulator as it is now: a changed model, judged on the same runs)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.results_file import write_results
from bench.serve_load import RequestSpec, client_session, send_one, warm_up
from bench.serve_machine import machine_info
from bench.serve_report import write_block
from bench.serve_stats import SLO, RequestRecord, summarize
from bench.serve_systems import MODEL_NAME, Server, ServerConfig, export_hf
from shared.planner.metrics import SLO as SimSLO
from shared.planner.metrics import summarize as sim_summarize
from shared.planner.metrics import tpot_s as sim_tpot_s
from shared.planner.metrics import ttft_s as sim_ttft_s
from shared.planner.profile import MachineShape, Profile
from shared.planner.sim_engine import SimRequest
from shared.planner.simulator import Shape, SimOptions, simulate
from shared.planner.workload import TraceRequest, synthetic

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.plan_validate")
SHAPES = {"colocated": Shape(0, 1, 0, colocated=True), "1P1D": Shape(1, 1), "1P2D": Shape(1, 2),
          "2P1D": Shape(2, 1)}
FIGURES = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "goodput_req_s")


def capped_trace(rate: float, num_requests: int, seed: int, max_prompt: int, max_output: int) -> list[TraceRequest]:
    """The chat workload at `rate`, lengths capped so that two cores serve it at a few requests a minute."""
    return [TraceRequest(r.arrival_s, min(r.prompt_tokens, max_prompt), min(r.output_tokens, max_output),
                         r.prefix_group, min(r.prefix_tokens, max_prompt))
            for r in synthetic("chat", rate, num_requests, seed)]


def trace_specs(trace: Sequence[TraceRequest], vocab_ids: Sequence[int], seed: int) -> list[RequestSpec]:
    """Exact-length completions; a prefix group's requests share their first prefix_tokens token ids."""
    rng = random.Random(seed)
    groups: dict[str, list[int]] = {}
    specs = []
    for r in trace:
        shared = groups.setdefault(r.prefix_group, [rng.choice(vocab_ids) for _ in range(4096)]) \
            if r.prefix_group else []
        prompt = shared[: r.prefix_tokens] + [rng.choice(vocab_ids) for _ in range(r.prompt_tokens - r.prefix_tokens)]
        specs.append(RequestSpec("/v1/completions", {"prompt": prompt, "max_tokens": r.output_tokens,
                                                     "min_tokens": r.output_tokens, "ignore_eos": True,
                                                     "temperature": 0.0}))
    return specs


async def replay(base_url: str, trace: Sequence[TraceRequest], specs: Sequence[RequestSpec],
                 timeout_s: float) -> tuple[list[RequestRecord], float]:
    """Send each request at its trace time; the run's records and its span (first send to last token)."""
    records = [RequestRecord(sent_s=0.0, error="unfinished at the run timeout") for _ in specs]
    async with client_session(base_url, len(specs) + 1, timeout_s) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + trace[i].arrival_s - time.perf_counter()))
            records[i] = await send_one(client, MODEL_NAME, specs[i], timeout_s)
        try:
            async with asyncio.timeout(timeout_s + trace[-1].arrival_s):
                await asyncio.gather(*(one(i) for i in range(len(specs))))
        except TimeoutError:
            pass
    ends = [r.token_times_s[-1] for r in records if r.ok]
    return records, (max(ends) - start) if ends else 0.0


def error(predicted: float, measured: float) -> float | None:
    return None if not measured or measured != measured else round((predicted - measured) / measured, 3)


def compare(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, Any]:
    return {name: {"predicted": round(predicted[name], 2), "measured": round(measured[name], 2),
                   "error": error(predicted[name], measured[name])} for name in FIGURES}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def request_rows(trace: Sequence[TraceRequest], records: Sequence[RequestRecord],
                 simulated: Sequence[SimRequest]) -> list[dict[str, Any]]:
    """Each request as measured beside the simulator's plain run of it, in trace order: which requests make a
    point's tail, and whether the simulator has them late too (None where the request failed)."""
    rows = [{"arrival_s": round(t.arrival_s, 3), "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
             "ttft_ms": _ms(r.ttft_s) if r.ok else None, "tpot_ms": _ms(r.tpot_s) if r.ok else None,
             **(gaps_ms(r.token_times_s) if r.ok else {})}
            for t, r in zip(trace, records, strict=True)]
    return repredicted(rows, simulated)


def gaps_ms(token_times_s: Sequence[float], prefix: str = "") -> dict[str, float]:
    """The gap from the first token to the second (in a split stack, the handoff's pull and the decode's first
    step) and the longest gap after it: whether a request's TPOT is late at its start or in its stream."""
    gaps = [b - a for a, b in zip(token_times_s, token_times_s[1:], strict=False)]
    if not gaps:
        return {}
    return {f"{prefix}first_gap_ms": _ms(gaps[0]), f"{prefix}max_later_gap_ms": _ms(max(gaps[1:], default=0.0))}


def repredicted(rows: Sequence[dict[str, Any]], simulated: Sequence[SimRequest]) -> list[dict[str, Any]]:
    """`rows` (request_rows) with the predictions of `simulated`, the same trace's run through the simulator."""
    return [{**row, "predicted_ttft_ms": _ms(sim_ttft_s(p)), "predicted_tpot_ms": _ms(sim_tpot_s(p)),
             **gaps_ms(p.token_times_s, "predicted_")}
            for row, p in zip(rows, simulated, strict=True)]


def measured_summary(records: list[RequestRecord], span_s: float, slo: SLO) -> dict[str, float]:
    summary = summarize(records, span_s, slo)
    met = sum(slo.met_by(r) for r in records)
    summary["goodput_req_s"] = met / span_s if span_s > 0 else 0.0
    return summary


PROBE_LENGTHS = (64, 256)  # prompt tokens of the probe requests: two, to tell a fixed cost from a per-token one
PROBE_REPEATS = 3
PROBE_OUTPUT = 16


def alone(profile: Profile, shape: Shape, prompt_tokens: int, output_tokens: int,
          options: SimOptions) -> tuple[float, float]:
    """(TTFT, TPOT) the simulator predicts for one request alone on the fleet."""
    request = simulate(profile, shape, [TraceRequest(0.0, prompt_tokens, output_tokens)], options)[0]
    times = request.token_times_s
    return request.first_token_s - request.arrival_s, (times[-1] - times[0]) / max(1, len(times) - 1)


def probe_stack(base_url: str, vocab: Sequence[int], profile: Profile, shape: Shape, seed: int,
                timeout_s: float) -> dict[str, Any]:
    """Probe requests one at a time (fresh prompts) against the simulator's prediction for each alone: the
    serving overhead (s) and the prefill and decode speed of the machine now, as multiples of the profile's."""
    rng = random.Random(seed)
    options = SimOptions(cores=os.cpu_count())
    rows = []
    for length in PROBE_LENGTHS:
        for _ in range(PROBE_REPEATS):
            spec = RequestSpec("/v1/completions", {"prompt": [rng.choice(vocab) for _ in range(length)],
                                                   "max_tokens": PROBE_OUTPUT, "min_tokens": PROBE_OUTPUT,
                                                   "ignore_eos": True, "temperature": 0.0})

            async def send(spec: RequestSpec = spec) -> RequestRecord:
                async with client_session(base_url, 1, timeout_s) as client:
                    return await send_one(client, MODEL_NAME, spec, timeout_s)
            record = asyncio.run(send())
            if not record.ok:
                raise RuntimeError(f"probe request failed: {record.error}")
            times = record.token_times_s
            rows.append({"prompt_tokens": length, "ttft_s": record.ttft_s,
                         "tpot_s": (times[-1] - times[0]) / max(1, len(times) - 1)})
    predicted = {n: alone(profile, shape, n, PROBE_OUTPUT, options) for n in PROBE_LENGTHS}
    return {"rows": rows, **fit_probe(rows, predicted)}


def fit_probe(rows: Sequence[dict[str, float]], predicted: dict[int, tuple[float, float]]) -> dict[str, float]:
    """Measured TTFT(n) = overhead + prefill_scale × predicted TTFT(n), solved on the medians of the two probe
    lengths (the scale held to 0.5 .. 2, the overhead to >= 0); decode_scale = median measured / predicted
    TPOT."""
    short, long = sorted(predicted)
    ttft = {n: statistics.median(r["ttft_s"] for r in rows if r["prompt_tokens"] == n) for n in (short, long)}
    prefill_scale = (ttft[long] - ttft[short]) / max(predicted[long][0] - predicted[short][0], 1e-9)
    prefill_scale = min(max(prefill_scale, 0.5), 2.0)
    overhead = max(0.0, ttft[short] - prefill_scale * predicted[short][0])
    decode_scale = statistics.median(r["tpot_s"] / predicted[int(r["prompt_tokens"])][1] for r in rows)
    return {"router_overhead_s": round(overhead, 4), "prefill_scale": round(prefill_scale, 3),
            "decode_scale": round(decode_scale, 3)}


def bracketed(before: dict[str, Any], after: dict[str, Any] | None) -> dict[str, Any]:
    """The probes before and after a trace as one: the mean of each fitted figure (the machine's speed
    during the trace, between the two); `before` alone where no probe followed (runs before 2026-11-29)."""
    if after is None:
        return before
    return {k: round((before[k] + after[k]) / 2, 4) for k in ("router_overhead_s", "prefill_scale", "decode_scale")}


def run_shape(name: str, config: ServerConfig, profile: Profile, args: argparse.Namespace,
              vocab: Sequence[int]) -> list[dict[str, Any]]:
    shape = SHAPES[name]
    up_args = ("--mode", "colocated") if shape.colocated else \
        ("--prefill", str(shape.num_prefill), "--decode", str(shape.num_decode))
    slo = SLO(args.ttft_slo, args.tpot_slo)
    points = []
    with Server("baton", config, up_args=up_args, name=f"plan-{name}") as server:
        asyncio.run(warm_up(server.base_url, MODEL_NAME, vocab))
        for i, rate in enumerate(args.rates):
            # probed again before every rate: this machine's speed drifts by a fifth within minutes
            probe = probe_stack(server.base_url, vocab, profile, shape, args.seed * 1000 + 900 + i, args.timeout)
            logger.info("%s probe: serving overhead %.1f ms, prefill x%.2f, decode x%.2f of the profile", name,
                        probe["router_overhead_s"] * 1e3, probe["prefill_scale"], probe["decode_scale"])
            trace = capped_trace(rate, args.requests, args.seed, args.max_prompt, args.max_output)
            logger.info("%s at %.3g req/s: %d requests ...", name, rate, len(trace))
            # fresh token ids at every rate: the same prompts again would be prefix-cache hits of the last run
            specs = trace_specs(trace, vocab, args.seed * 1000 + i + 1)
            records, span = asyncio.run(replay(server.base_url, trace, specs, args.timeout))
            measured = measured_summary(records, span, slo)
            probe_after = probe_stack(server.base_url, vocab, profile, shape, args.seed * 1000 + 950 + i,
                                      args.timeout)
            logger.info("%s probe after: serving overhead %.1f ms, prefill x%.2f, decode x%.2f of the profile",
                        name, probe_after["router_overhead_s"] * 1e3, probe_after["prefill_scale"],
                        probe_after["decode_scale"])
            # plain; on fixed shares (the simulator before it modelled `baton up`'s lent cores); probed
            predicted, plain = predictions(profile, name, rate, args, probe, probe_after)
            point = {"shape": name, "rate": rate, "num_failed": measured["num_failed"],
                     "measured_attainment": measured.get("slo_attainment"),
                     "predicted_attainment": predicted["figures"]["slo_attainment"],
                     **{key: compare(figures, measured) for key, figures in predicted.items()},
                     "probe": probe, "probe_after": probe_after,
                     "ttfts_ms": sorted(round(r.ttft_s * 1e3, 1) for r in records if r.ok),
                     "requests": request_rows(trace, records, plain)}
            logger.info("%s at %.3g req/s: %s; probed %s", name, rate,
                        {k: v["error"] for k, v in point["figures"].items()},
                        {k: v["error"] for k, v in point["figures_probed"].items()})
            points.append(point)
    return points


def scaled(profile: Profile, prefill_scale: float, decode_scale: float) -> Profile:
    """A copy of `profile` whose prefill and decode step times are multiplied by the scales."""
    copy = Profile.from_json(json.loads(json.dumps(profile.to_json())))
    for curves in copy.engines.values():
        curves.prefill_fit = [c * prefill_scale for c in curves.prefill_fit]
        curves.decode_fit = [c * decode_scale for c in curves.decode_fit]
        curves.decode_points = [[b, c, s * decode_scale] for b, c, s in curves.decode_points]  # what decode_step_s interpolates
    return copy


def calibrated(points: list[dict[str, Any]], profile: Profile, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Attempt 2: per shape, scale the prefill curve by measured / predicted p50 TTFT and the decode curve by
    measured / predicted p50 TPOT at the shape's lowest rate (the machine's speed during this run, which a
    shared machine moves), then predict every rate again; the lowest rate is fitted, the others held out."""
    out = []
    for name in sorted({p["shape"] for p in points}):
        mine = sorted((p for p in points if p["shape"] == name), key=lambda p: p["rate"])
        low = mine[0]["figures"]
        prefill_scale = low["p50_ttft_ms"]["measured"] / max(low["p50_ttft_ms"]["predicted"], 1e-9)
        decode_scale = low["p50_tpot_ms"]["measured"] / max(low["p50_tpot_ms"]["predicted"], 1e-9)
        tuned = scaled(profile, prefill_scale, decode_scale)
        for p in mine:
            trace = capped_trace(p["rate"], args.requests, args.seed, args.max_prompt, args.max_output)
            predicted = sim_summarize(simulate(tuned, SHAPES[name], trace, SimOptions(cores=os.cpu_count())),
                                      SimSLO(args.ttft_slo, args.tpot_slo))
            measured = {k: v["measured"] for k, v in p["figures"].items()}
            out.append({"shape": name, "rate": p["rate"], "fitted": p is mine[0],
                        "prefill_scale": round(prefill_scale, 3), "decode_scale": round(decode_scale, 3),
                        "figures": compare(predicted, measured)})
    return out


def figure_table(points: Sequence[dict[str, Any]], key: str) -> list[str]:
    """Markdown rows of each point's figures under `key`: predicted / measured (error)."""
    lines = ["| shape | rate | " + " | ".join(FIGURES) + " |", "|---|---|" + "---|" * len(FIGURES)]
    for p in points:
        cells = [f"{f['predicted']:.3g} / {f['measured']:.3g} ({f['error']:+.0%})" if f["error"] is not None
                 else f"{f['predicted']:.3g} / {f['measured']:.3g}" for f in (p[key][n] for n in FIGURES)]
        lines.append(f"| {p['shape']} | {p['rate']} | " + " | ".join(cells) + " |")
    return lines


def readme_table(result: dict[str, Any]) -> str:
    lines = [f"Predicted (simulator, profile `{result['profile_file']}`) against measured (`baton up`), chat "
             f"workload capped at {result['max_prompt']}/{result['max_output']} tokens, {result['requests']} "
             f"requests per point, SLO TTFT {result['slo']['ttft_s']} s / TPOT {result['slo']['tpot_s']} s; "
             f"run `{result['file']}` (load average at start {result['machine'].get('loadavg_at_start', '?')})"
             + (f", the measurements of `{result['resimulated_from']}` against the simulator as it is now"
                if result.get("resimulated_from") else "") + ". Each cell: predicted / measured (error).", "",
             *figure_table(result["points"], "figures")]
    within = [abs(f["error"]) <= 0.15 for p in result["points"] for f in p["figures"].values() if f["error"] is not None]
    lines += ["", f"Points within 15%: {sum(within)} of {len(within)}."]
    fixed = [abs(f["error"]) <= 0.15 for p in result["points"] for f in p.get("figures_fixed_shares", {}).values()
             if f["error"] is not None]
    if fixed:
        lines.append(f"The same measurements against the simulator with each engine on a fixed share of the cores "
                     f"(no lent cores, `SimOptions(core_share=False)`): {sum(fixed)} of {len(fixed)} within 15%.")
    probed = [abs(f["error"]) <= 0.15 for p in result["points"] for f in p.get("figures_probed", {}).values()
              if f["error"] is not None]
    before = [abs(f["error"]) <= 0.15 for p in result["points"] for f in p.get("figures_probed_before", {}).values()
              if f["error"] is not None]
    if probed:
        when = "before and after" if before else "before"
        lines.append(f"Probed (each stack's serving overhead and the machine's prefill and decode speed, from probe "
                     f"requests served alone {when} each rate's trace; every trace point held out): {sum(probed)} of "
                     f"{len(probed)} within 15%." + (f" With the probe before each trace alone: {sum(before)} of "
                                                     f"{len(before)}." if before else ""))
    if probed:
        lines += ["", "Probed, each point (the simulator with the probes' overhead and speeds):", "",
                  *figure_table(result["points"], "figures_probed")]
    held_out = [abs(f["error"]) <= 0.15 for p in result.get("calibrated", []) if not p["fitted"]
                for f in p["figures"].values() if f["error"] is not None]
    if held_out:
        lines.append(f"Calibrated on each shape's lowest rate (prefill and decode speed of this run), the other "
                     f"rates' points within 15%: {sum(held_out)} of {len(held_out)}.")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, name in zip(axes, FIGURES[:4], strict=False):
        for shape in SHAPES:
            pts = [p for p in result["points"] if p["shape"] == shape]
            if pts:
                ax.plot([p["figures"][name]["measured"] for p in pts], [p["figures"][name]["predicted"] for p in pts],
                        "o-", label=shape)
        top = max([1.0] + [p["figures"][name][k] for p in result["points"] for k in ("measured", "predicted")])
        ax.plot([0, top], [0, top], "k--", lw=0.5)
        ax.set_title(name)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    return True


def predictions(profile: Profile, shape_name: str, rate: float, args: argparse.Namespace,
                probe: dict[str, Any] | None, probe_after: dict[str, Any] | None = None,
                ) -> tuple[dict[str, dict[str, float]], list[SimRequest]]:
    """The simulator's figures for one point (plain, on fixed core shares, and probed when a probe ran: with
    the probes before and after the trace, and with the one before alone), and the plain run's requests."""
    shape = SHAPES[shape_name]
    slo = SimSLO(args.ttft_slo, args.tpot_slo)
    trace = capped_trace(rate, args.requests, args.seed, args.max_prompt, args.max_output)
    plain = simulate(profile, shape, trace, SimOptions(cores=os.cpu_count()))
    out = {"figures": sim_summarize(plain, slo),
           "figures_fixed_shares": sim_summarize(simulate(profile, shape, trace, SimOptions(
               cores=os.cpu_count(), core_share=False)), slo)}
    def probed(fit: dict[str, Any]) -> dict[str, float]:
        return sim_summarize(simulate(scaled(profile, fit["prefill_scale"], fit["decode_scale"]), shape, trace,
                                      SimOptions(cores=os.cpu_count(), router_overhead_s=fit["router_overhead_s"])),
                             slo)
    if probe is not None:
        out["figures_probed"] = probed(bracketed(probe, probe_after))
        if probe_after is not None:
            out["figures_probed_before"] = probed(probe)
    return out, plain


def resimulate(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A results file's measured points against the simulator as it is now."""
    old = json.loads(path.read_text())
    profile = Profile.from_json(old["profile"])
    args.requests, args.max_prompt, args.max_output = old["requests"], old["max_prompt"], old["max_output"]
    args.ttft_slo, args.tpot_slo = old["slo"]["ttft_s"], old["slo"]["tpot_s"]
    result = {**old, "resimulated_from": path.name, "points": []}
    result.pop("calibrated", None)
    # older runs probed each shape once, before its first rate (its first point holds it); newer ones every rate
    first_probes: dict[str, dict[str, Any]] = {}
    for p in old["points"]:
        if p.get("probe"):
            first_probes.setdefault(p["shape"], p["probe"])
    for point in old["points"]:
        measured = {k: v["measured"] for k, v in point["figures"].items()}
        new = {**point}
        predicted, plain = predictions(profile, point["shape"], point["rate"], args,
                                       point.get("probe") or first_probes.get(point["shape"]), point.get("probe_after"))
        for key, figures in predicted.items():
            new[key] = compare(figures, measured)
        if "requests" in point:  # each request's prediction too, from the simulator as it is now
            new["requests"] = repredicted(point["requests"], plain)
        result["points"].append(new)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 requests per point, short outputs")
    parser.add_argument("--profile", type=Path, default=None, help="default: `baton profile` now (--quick too)")
    parser.add_argument("--quick-profile", action="store_true", help="`baton profile --quick` (implied by --quick)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rates", default="0.25,0.5,1.0")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--ttft-slo", type=float, default=3.0)
    parser.add_argument("--tpot-slo", type=float, default=0.3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/baton/bench-plan")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--resimulate", type=Path, default=None,
                        help="a results file: its measurements against the simulator as it is now")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.resimulate is not None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
        return finish(resimulate(args.resimulate, args), args)
    if args.quick:
        args.requests, args.max_output = min(args.requests, 8), min(args.max_output, 16)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.profile is None:
        args.profile = args.work_dir / "profile.json"
        quick = args.quick or args.quick_profile
        logger.info("profiling this machine (baton profile%s) ...", " --quick" if quick else "")
        subprocess.run([sys.executable, "-m", "shared.cli.main", "profile", "--out", str(args.profile),
                        *(["--quick"] if quick else [])], check=True)
    profile = Profile.load(args.profile)
    profile.check_machine(MachineShape.this_machine())
    config = ServerConfig(work_dir=args.work_dir, hf_dir=export_hf(args.work_dir), port=args.port,
                          vllm_venv=Path("/nonexistent"))
    from bench.serve import vocab_ids

    vocab = vocab_ids(config.hf_dir)
    result: dict[str, Any] = {
        "bench": "plan_validate", "quick": args.quick, "profile_file": str(args.profile),
        "profile": profile.to_json(), "machine": machine_info(Path("/nonexistent")), "requests": args.requests,
        "max_prompt": args.max_prompt, "max_output": args.max_output, "rates": args.rates,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo}, "points": []}
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        try:
            result["points"] += run_shape(name, config, profile, args, vocab)
        except (RuntimeError, TimeoutError) as exc:
            logger.error("%s failed: %s", name, exc)
            result.setdefault("errors", {})[name] = str(exc)
    if args.calibrate and result["points"]:
        result["calibrated"] = calibrated(result["points"], profile, args)
    result["wall_s"] = round(time.monotonic() - started, 1)
    return finish(result, args)


def finish(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Score, write and report a run (or a resimulated one)."""
    errors = [abs(f["error"]) for p in result["points"] for f in p["figures"].values() if f["error"] is not None]
    result["median_abs_error"] = statistics.median(errors) if errors else None
    path = write_results(result, args.out, "plan_validate", indent=None, record_name=True)
    logger.info("wrote %s", path)
    if result["points"] and not args.no_readme:
        write_block(Path(__file__).parent / "README.md", "plan_validate", readme_table(result))
        if plot(result, args.out / path.name.replace(".json", ".png")):
            logger.info("plotted %s", path.name.replace(".json", ".png"))
    print(json.dumps({"bench": "plan_validate", "file": path.name, "median_abs_error": result["median_abs_error"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
