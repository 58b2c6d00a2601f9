"""`baton autoscale`: the SLA planner loop, exporting desired replicas per service for an HPA to follow.

    baton autoscale --profile P --workload chat --slo ttft=1,tpot=100ms --router-metrics URL[,URL...]
                    [--host 127.0.0.1] [--port 9500] [--interval 15] [--window 60] [--rate-step 0.5]

shared/planner/autoscaler.py has the loop; deploy/k8s/overlays/planner-autoscaling wires HPAs to it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from prometheus_client import start_http_server

from shared.errors import ConfigError
from shared.planner.autoscaler import Autoscaler, PlannerConfig, RateMeter, run_loop
from shared.planner.metrics import SLO
from shared.planner.profile import Profile
from shared.planner.search import SearchLimits
from shared.planner.workload import WORKLOADS

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("autoscale", help="export desired replicas per service from the router's observed rate")
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--workload", default="chat", choices=WORKLOADS, help="the traffic's shape (its rate is observed)")
    p.add_argument("--slo", required=True, help="ttft=SECONDS,tpot=SECONDS")
    p.add_argument("--router-metrics", required=True,
                   help="routers' /metrics URLs, comma-separated; dns+http://NAME:PORT/metrics: every address of NAME")
    p.add_argument("--host", default="127.0.0.1", help="where this loop serves its own /metrics")
    p.add_argument("--port", type=int, default=9500)
    p.add_argument("--interval", type=float, default=15.0, help="seconds between scrapes")
    p.add_argument("--window", type=float, default=60.0, help="seconds the rate is measured over")
    p.add_argument("--rate-step", type=float, default=0.5, help="req/s; rates round up to a multiple")
    p.add_argument("--max-per-service", type=int, default=64)
    p.add_argument("--iterations", type=int, default=None, help="stop after N scrapes (default: never)")
    p.set_defaults(func=run_autoscale)


def run_autoscale(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise ConfigError(f"--interval must be > 0 s, got {args.interval}")
    profile = Profile.load(args.profile)
    config = PlannerConfig(workload=args.workload, slo=SLO.parse(args.slo), rate_step=args.rate_step,
                           limits=SearchLimits(max_per_service=args.max_per_service))
    autoscaler = Autoscaler(profile, config)
    meter = RateMeter(args.window)
    server, _ = start_http_server(args.port, args.host, registry=autoscaler.registry)
    logger.info("planner: serving desired replicas on http://%s:%d/metrics, scraping %s every %g s",
                args.host, server.server_port, args.router_metrics, args.interval)
    try:
        run_loop(autoscaler, args.router_metrics, meter, args.interval, args.iterations)
    finally:
        server.shutdown()
    return 0
