"""baton plan's simulator against Vidur on the same measured runs: colocated points of a plan_validate run.

    a plan_validate-*.json (its profile, its measured colocated points, the seed's traces)
    ─► for each colocated rate: the trace through
         baton's simulator (shared/planner/simulator.py, as `baton plan` runs it)
         Vidur 0.0.26 (bench/vidur_driver.py in its own venv, ~/.cache/baton/vidur-venv, made on first use):
           its Sarathi chunked-prefill scheduler with the profile's chunk and batch limits, its step times
           from the same profile (Vidur's GPU-trained predictor has no CPU data and needs the HF hub)
       ─► p50/p99 TTFT and TPOT of each, against what the run measured
    ─► JSON in bench/results/vidur_compare-*.json, a table in bench/README.md

Vidur simulates replicas that each prefill and decode (it has no prefill/decode split), so only the
colocated shape is compared; with the step times shared, what differs is the scheduling model.

    .venv/bin/python -m bench.vidur_compare [--run bench/results/plan_validate-<stamp>.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.plan_validate import FIGURES, SHAPES, capped_trace, error
from bench.results_file import write_results
from bench.serve_report import write_block
from shared.planner.metrics import SLO, summarize
from shared.planner.profile import Profile
from shared.planner.sim_engine import SimRequest
from shared.planner.simulator import SimOptions, simulate
from shared.planner.workload import TraceRequest

RESULTS = Path(__file__).parent / "results"
VIDUR = "vidur==0.0.26"
VENV = Path.home() / ".cache/baton/vidur-venv"
DRIVER = Path(__file__).parent / "vidur_driver.py"
SEED = 0  # plan_validate's default --seed: the runs it judges used it
KV_BLOCKS = 1 << 16  # the traces here never fill the engine's cache; Vidur is given room to match
logger = logging.getLogger("bench.vidur_compare")


def vidur_python() -> Path:
    """Vidur's interpreter: a venv of its own (its pins, numpy and pandas among them, are not baton's)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        logger.info("installing %s into %s (first use) ...", VIDUR, VENV)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", VIDUR], check=True)
    return python


def vidur_spec(profile: Profile, trace: list[TraceRequest]) -> dict[str, Any]:
    curves = profile.curves(profile.machine.cores)  # the colocated engine computes on every core
    return {"fits": {"prefill": curves.prefill_fit, "decode": curves.decode_fit,
                     "decode_lines": curves.decode_lines()},
            "requests": [[r.arrival_s, r.prompt_tokens, r.output_tokens] for r in trace],
            "num_blocks": KV_BLOCKS, "block_size": profile.block_size,
            "chunk_size": profile.max_num_batched_tokens, "max_num_seqs": profile.max_num_seqs}


def run_vidur(spec: dict[str, Any]) -> list[list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(spec))
        done = subprocess.run([str(vidur_python()), str(DRIVER), str(src), str(dst)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"vidur failed: {done.stderr[-2000:]}")
        return json.loads(dst.read_text())["requests"]


def as_sim_requests(trace: list[TraceRequest], timings: list[list[float]]) -> list[SimRequest]:
    """Vidur's per-request TTFT and TPOT as SimRequests, so both simulators are summarized by one function."""
    out = []
    for i, (r, (ttft, tpot)) in enumerate(zip(trace, timings, strict=True)):
        request = SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens)
        request.first_token_s = r.arrival_s + ttft
        request.token_times_s = [request.first_token_s, request.first_token_s + tpot * max(0, r.output_tokens - 1)]
        out.append(request)
    return out


def compare_run(run: dict[str, Any]) -> list[dict[str, Any]]:
    profile = Profile.from_json(run["profile"])
    slo = SLO(run["slo"]["ttft_s"], run["slo"]["tpot_s"])
    points = []
    for point in (p for p in run["points"] if p["shape"] == "colocated"):
        trace = capped_trace(point["rate"], run["requests"], SEED, run["max_prompt"], run["max_output"])
        measured = {k: v["measured"] for k, v in point["figures"].items()}
        baton = summarize(simulate(profile, SHAPES["colocated"], trace, SimOptions(cores=profile.machine.cores)), slo)
        vidur = summarize(as_sim_requests(trace, run_vidur(vidur_spec(profile, trace))), slo)
        row: dict[str, Any] = {"rate": point["rate"], "figures": {}}
        for name in FIGURES:
            row["figures"][name] = {"measured": measured[name], "baton": round(baton[name], 3),
                                    "vidur": round(vidur[name], 3), "baton_error": error(baton[name], measured[name]),
                                    "vidur_error": error(vidur[name], measured[name])}
        logger.info("rate %.2f: %s", point["rate"], ", ".join(
            f"{n} baton {f['baton_error']:+.3f} vidur {f['vidur_error']:+.3f}" for n, f in row["figures"].items()
            if f["baton_error"] is not None and f["vidur_error"] is not None))
        points.append(row)
    if not points:
        raise SystemExit(f"{run['file']} has no colocated point to compare")
    return points


def readme_table(result: dict[str, Any]) -> str:
    lines = [f"`baton plan`'s simulator and Vidur {result['vidur']} against the colocated runs of "
             f"`{result['run']}` (`bench/vidur_compare.py`, `{result['file']}`; the same step times for both, "
             "Vidur's Sarathi scheduler): predicted / measured, error in brackets", "",
             "| rate | simulator | " + " | ".join(FIGURES) + " |", "|---|---|" + "---|" * len(FIGURES)]
    for point in result["points"]:
        for who in ("baton", "vidur"):
            cells = []
            for name in FIGURES:
                f = point["figures"][name]
                err = f[f"{who}_error"]
                cells.append(f"{f[who]:.3g} / {f['measured']:.3g} ({err:+.1%})" if err is not None else "-")
            lines.append(f"| {point['rate']} | {who} | " + " | ".join(cells) + " |")
    within = {who: sum(1 for p in result["points"] for f in p["figures"].values()
                       if f[f"{who}_error"] is not None and abs(f[f"{who}_error"]) <= 0.15) for who in ("baton", "vidur")}
    total = sum(1 for p in result["points"] for f in p["figures"].values() if f["baton_error"] is not None)
    lines += ["", f"Within 15%: baton {within['baton']} of {total}, Vidur {within['vidur']} of {total}."]
    return "\n".join(lines)


def latest_run() -> Path:
    def full(path: Path) -> bool:  # measured, not a --quick run nor a re-scoring of one
        run = json.loads(path.read_text())
        return not run.get("quick") and "resimulated_from" not in run

    runs = [p for p in sorted(RESULTS.glob("plan_validate-*.json")) if full(p)]
    if not runs:
        raise SystemExit("no full plan_validate run in bench/results")
    return runs[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=None, help="a plan_validate-*.json (default: the latest full run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    path = args.run or latest_run()
    run = json.loads(path.read_text())
    run.setdefault("file", path.name)
    result: dict[str, Any] = {"bench": "vidur_compare", "vidur": VIDUR, "run": path.name,
                              "points": compare_run(run)}
    out = write_results(result, args.out, "vidur_compare", record_name=True)
    logger.info("wrote %s", out)
    if args.out == RESULTS:
        write_block(Path(__file__).parent / "README.md", "vidur_compare", readme_table(result))
    print(json.dumps({"bench": "vidur_compare", "file": out.name, "run": path.name}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
