"""The plan for 1,000 requests/s of the chat workload on one kind of GPU: a GPU profile, then `baton plan`'s search.

The profile's engine curves come from a lent GPU (default: `--engine-curves`, bench/gpu_profile.py: prefill and
decode both measured through the engine on SmolLM2-135M's shapes, random weights, bf16, decode from CUDA
graphs). Without one (`--engine-curves none`) it is part measured, part roofline, and says so:

```
 decode   measured on an H100: bench/results/cuda_loop-*.json (SmolLM2-135M's shapes, random weights, bf16,
          CUDA graphs and the zero-bubble loop), ms per step at batch 1/8/32/64 → decode_fit
 prefill  roofline: 2 × parameters FLOPs per token (+ attention's 2 × layers × n² × q width) at
          --mfu × 989 TFLOP/s (H100 SXM bf16 dense), on top of the eager forward's floor (prefill runs
          eagerly; the same file's eager steps, the fastest of them, are that floor)
```

Either way the handoff is assumed: --link-gbs GB/s (NIXL over RDMA) and 1 ms per handoff (one GPU machine is
lent at a time, so no transfer between two was measured).

    .venv/bin/python -m bench.plan_gpu [--rate 1000] [--slo ttft=1,tpot=50ms] [--requests 10000]

Writes the profile and the plan to bench/results/ and the table to bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from bench.serve_report import write_block
from shared.planner.metrics import SLO
from shared.planner.profile import EngineCurves, HandoffCurves, MachineShape, Profile
from shared.planner.search import SearchLimits, search
from shared.planner.simulator import SimOptions
from shared.planner.workload import synthetic

RESULTS = Path(__file__).parent / "results"
H100_BF16_FLOPS = 989e12  # dense, SXM
# SmolLM2-135M: 30 layers, hidden 576, 9 query heads x 64, 3 KV heads x 64, MLP 1536, vocab 49,152 (tied)
SMOLLM2 = {"params": 134_515_008, "layers": 30, "q_width": 576, "kv_bytes_per_token_bf16": 30 * 2 * 3 * 64 * 2,
           "hidden_bytes_bf16": 576 * 2}
logger = logging.getLogger("bench.plan_gpu")


def decode_curves(cuda_loop: dict[str, Any]) -> tuple[list[list[float]], float]:
    """Decode points (graphs + zero-bubble rows) and the eager forward's floor (s) from a cuda_loop result."""
    context = cuda_loop["prompt_len"] + cuda_loop["new_tokens"] / 2  # mean context over the timed steps
    points = [[r["batch"], context, r["ms_per_step"] / 1e3] for r in cuda_loop["rows"]
              if r["loop"] == "async" and r["cuda_graphs"]]
    eager_floor = min(r["ms_per_step"] for r in cuda_loop["rows"] if not r["cuda_graphs"]) / 1e3
    return points, eager_floor


def h100_profile(cuda_loop_path: Path, mfu: float, link_gbs: float) -> Profile:
    cuda_loop = json.loads(cuda_loop_path.read_text())
    points, eager_floor = decode_curves(cuda_loop)
    curves = EngineCurves(decode_points=points)
    per_token = 2 * SMOLLM2["params"] / (H100_BF16_FLOPS * mfu)
    attention = 2 * SMOLLM2["layers"] * SMOLLM2["q_width"] / (H100_BF16_FLOPS * mfu)
    curves.prefill_points = [[1, n, n, eager_floor + per_token * n + attention * n * n] for n in (16, 256, 1024, 2048)]
    curves.refit()
    return gpu_profile(curves, cuda_loop["device"], link_gbs,
                       f"decode measured on an {cuda_loop['device']} ({cuda_loop_path.name}); prefill a roofline "
                       f"({mfu:.0%} of 989 TFLOP/s bf16 over the eager floor {eager_floor * 1e3:.1f} ms)")


def measured_profile(engine_curves_path: Path, link_gbs: float) -> Profile:
    """Prefill and decode both measured on a lent GPU through the engine (bench/gpu_profile.py)."""
    measured = json.loads(engine_curves_path.read_text())
    curves = EngineCurves(prefill_points=measured["prefill_points"], decode_points=measured["decode_points"])
    curves.refit()
    return gpu_profile(curves, measured["device"], link_gbs,
                       f"prefill and decode measured on an {measured['device']} through the engine "
                       f"({engine_curves_path.name}: random weights of SmolLM2-135M's shapes, {measured['dtype']}, "
                       f"decode from CUDA graphs in the synchronous loop)")


def gpu_profile(curves: EngineCurves, device: str, link_gbs: float, measured: str) -> Profile:
    """One GPU's profile: `curves`, and a handoff assumed at `link_gbs` (no second GPU machine is lent)."""
    kv_bytes = SMOLLM2["kv_bytes_per_token_bf16"] + SMOLLM2["hidden_bytes_bf16"]
    handoff = HandoffCurves(transport="nixl (assumed RDMA)", push_fit=[5e-4, 0.0],
                            pull_fit=[1e-3, 1 / (link_gbs * 1e9)])
    handoff.points = [[n * kv_bytes, handoff.push_s(n * kv_bytes), handoff.pull_s(n * kv_bytes)] for n in (256, 2048)]
    return Profile(
        model="smollm2-135m", model_identity="llama:30L:576H:3KV:64D:49152V",
        machine=MachineShape(1, ("cuda:sm_90",), device), block_size=16, kv_bytes_per_token=kv_bytes,
        max_num_batched_tokens=2048, max_num_seqs=64, engines={1: curves}, handoff=handoff,
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        notes=f"{measured}; handoff assumed {link_gbs:g} GB/s + 1 ms")


def readme_table(result: dict[str, Any]) -> str:
    plan = result["plan"]
    p = plan["predicted"]
    return "\n".join([
        f"{result['rate']:g} requests/s of the chat workload ({result['requests']} simulated), SLO TTFT "
        f"{result['slo']['ttft_s']} s / TPOT {result['slo']['tpot_s'] * 1e3:g} ms for 90% of requests, on "
        f"SmolLM2-135M per {result.get('device', 'NVIDIA H100 80GB HBM3')}. Profile: {result['profile_notes']}. "
        f"Run `{result['file']}`.", "",
        "| shape | prefill | decode | kv_transfer | P:D | TTFT p50 / p99 ms | TPOT p50 / p99 ms | attainment "
        "| SLO-meeting req/s (attainment × rate) |", "|---|---|---|---|---|---|---|---|---|",
        f"| {plan['shape']} | {plan['prefill']} | {plan['decode']} | {plan['kv_transfer']} | {plan['p_to_d']} | "
        f"{p['p50_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f} | {p['p50_tpot_ms']:.1f} / {p['p99_tpot_ms']:.1f} | "
        f"{p['slo_attainment']:.1%} | {p['slo_attainment'] * result['rate']:.0f} |"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-curves", type=Path, default=RESULTS / "gpu_profile-20261126-192010.json",
                        help="prefill and decode measured on a GPU (bench/gpu_profile.py); 'none': --cuda-loop's "
                        "decode and a prefill roofline")
    parser.add_argument("--cuda-loop", type=Path, default=RESULTS / "cuda_loop-20261122-183413.json")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--slo", default="ttft=1,tpot=50ms")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--mfu", type=float, default=0.5, help="prefill's share of the H100's peak FLOP/s")
    parser.add_argument("--link-gbs", type=float, default=40.0, help="handoff bandwidth, GB/s")
    parser.add_argument("--max-per-service", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    measured = str(args.engine_curves) != "none"
    profile = measured_profile(args.engine_curves, args.link_gbs) if measured else \
        h100_profile(args.cuda_loop, args.mfu, args.link_gbs)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    profile.save(args.out / f"profile-{'gpu' if measured else 'h100'}-{stamp}.json")
    slo = SLO.parse(args.slo)
    trace = synthetic("chat", args.rate, args.requests, seed=0)
    logger.info("searching the fleet for %g req/s (%d requests) ...", args.rate, len(trace))
    found = search(profile, trace, slo, SimOptions(), SearchLimits(max_per_service=args.max_per_service))
    shape = found.shape
    plan = {"shape": shape.describe(), "prefill": 0 if shape.colocated else shape.num_prefill,
            "decode": shape.num_decode, "kv_transfer": 0 if shape.colocated else shape.num_kv,
            "p_to_d": "colocated" if shape.colocated else f"{shape.num_prefill}:{shape.num_decode}",
            "predicted": found.summary}
    result = {"bench": "plan_gpu", "rate": args.rate, "requests": args.requests,
              "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "profile_notes": profile.notes,
              "device": profile.machine.cpu,
              "profile": profile.to_json(), "plan": plan, "file": f"plan_gpu-{stamp}.json"}
    (args.out / result["file"]).write_text(json.dumps(result, indent=1))
    if not args.no_readme:
        write_block(Path(__file__).parent / "README.md", "plan_gpu", readme_table(result))
    print(json.dumps({"bench": "plan_gpu", "file": result["file"], "plan": plan}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
