"""`baton plan`: the cheapest fleet meeting an SLO for a workload, by simulation over a measured profile.

    baton plan --profile P --workload chat|long-document|agentic|TRACE.jsonl --slo ttft=1,tpot=0.1 --rate R
               [--model M] [--out DIR] [--base deploy/k8s/overlays/cpu] [--peak-factor 2] [--attainment 0.9]
               [--num-requests 1000] [--policy kv] [--mode both|disagg|colocated] [--max-per-service 64]
               [--shared-cores C] [--threads T] [--seed 0]

Prints the plan (replicas per service, predicted TTFT and TPOT p50/p99, attainment, goodput) as JSON and,
with --out, writes a kustomize overlay (replicas at the rate, HPA maxima at rate × peak factor), checked
with `kubectl kustomize`. `--shared-cores C` simulates every engine on one host of C cores (what `baton up`
runs; the profile must come from this machine's shape); without it each instance has its own machine of
the profiled shape. An SLO no fleet meets exits 2 naming the stage that cannot.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.planner.metrics import SLO
from shared.planner.overlay import validate, write_overlay
from shared.planner.profile import MachineShape, Profile
from shared.planner.search import Candidate, SearchLimits, search
from shared.planner.simulator import POLICIES, SimOptions
from shared.planner.workload import workload

logger = logging.getLogger(__name__)
MODES = {"both": ("disagg", "colocated"), "disagg": ("disagg",), "colocated": ("colocated",)}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="size a fleet for a workload and SLO from a profile (`baton profile`)")
    p.add_argument("--profile", type=Path, required=True, help="a profile JSON from `baton profile`")
    p.add_argument("--workload", required=True, help="chat, long-document, agentic, or a JSONL trace")
    p.add_argument("--slo", required=True, help="ttft=SECONDS,tpot=SECONDS (e.g. ttft=1,tpot=100ms)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (a trace: rescaled to it)")
    p.add_argument("--model", default=None, help="the model to plan for; refused unless the profile's")
    p.add_argument("--out", type=Path, default=None, help="write a kustomize overlay here")
    p.add_argument("--base", type=Path, default=Path("deploy/k8s/overlays/cpu"), help="what the overlay patches")
    p.add_argument("--peak-factor", type=float, default=2.0, help="HPA maxima: the plan at rate × this")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    p.add_argument("--num-requests", type=int, default=1000, help="requests simulated (synthetic workloads)")
    p.add_argument("--policy", default="kv", choices=POLICIES, help="the router's routing policy")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0, help="the router's setting (-1: auto)")
    p.add_argument("--mode", default="both", choices=sorted(MODES), help="shapes to consider")
    p.add_argument("--max-per-service", type=int, default=64)
    p.add_argument("--shared-cores", type=int, default=None, help="simulate one host of this many cores")
    p.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: see docs)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_plan)


def _describe(found: Candidate) -> dict[str, Any]:
    shape = found.shape
    replicas = ({"colocated": shape.num_decode} if shape.colocated else
                {"prefill": shape.num_prefill, "decode": shape.num_decode, "kv_transfer": shape.num_kv})
    return {"shape": shape.describe(), "replicas": replicas,
            "predicted": {k: round(v, 4) for k, v in found.summary.items()}}


def _check_args(args: argparse.Namespace, profile: Profile) -> None:
    if args.model is not None:
        profile.check_model(args.model)
    if args.shared_cores is not None:
        if args.shared_cores < 1:
            raise ConfigError(f"--shared-cores must be >= 1, got {args.shared_cores}")
        profile.check_machine(MachineShape.this_machine())
    if args.peak_factor < 1:
        raise ConfigError(f"--peak-factor must be >= 1, got {args.peak_factor}")
    if args.max_per_service < 1 or args.num_requests < 1:
        raise ConfigError("--max-per-service and --num-requests must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")


def run_plan(args: argparse.Namespace) -> int:
    profile = Profile.load(args.profile)
    _check_args(args, profile)
    slo = SLO.parse(args.slo)
    options = SimOptions(policy=args.policy, cores=args.shared_cores, threads_per_engine=args.threads,
                         local_prefill_max_tokens=args.local_prefill_max_tokens)
    limits = SearchLimits(attainment=args.attainment, max_per_service=args.max_per_service)
    trace = workload(args.workload, args.rate, args.num_requests, args.seed)
    rate = args.rate or (len(trace) - 1) / max(trace[-1].arrival_s, 1e-9)
    logger.info("plan: %d requests of %s at %.3g req/s, SLO TTFT %g s, TPOT %g s", len(trace), args.workload,
                rate, slo.ttft_s, slo.tpot_s)
    found = search(profile, trace, slo, options, limits, MODES[args.mode])
    modes = ("colocated",) if found.shape.colocated else ("disagg",)
    peak_trace = workload(args.workload, rate * args.peak_factor, args.num_requests, args.seed)
    peak = search(profile, peak_trace, slo, options, limits, modes) if args.peak_factor > 1 else found
    plan = {"profile": str(args.profile), "model": profile.model, "machine": profile.machine.cpu,
            "profile_notes": profile.notes, "workload": args.workload, "rate_per_s": round(rate, 4),
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "attainment_target": args.attainment,
            "policy": args.policy, "shared_cores": args.shared_cores,
            "at_rate": _describe(found), "at_peak": {"rate_per_s": round(rate * args.peak_factor, 4),
                                                     **_describe(peak)}}
    if args.out is not None:
        write_overlay(args.out, args.base, found.shape, peak.shape, plan)
        validate(args.out)
        plan["overlay"] = str(args.out)
        logger.info("plan: overlay written to %s (kubectl kustomize renders it)", args.out)
    print(json.dumps(plan, indent=1))
    return 0
