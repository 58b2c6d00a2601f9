"""`baton profile`: measure one instance of each service on this machine and write a profile for `baton plan`.

    baton profile [--model smollm2-135m] [--out profile.json] [--quick] [--threads 1 2] [--transport auto]

The sweeps (shared/planner/profiler.py, profile_handoff.py): prefill step time against prompt length
and batch, decode step time against batch and context, per torch thread count; the handoff's cost
against its bytes through real kv_transfer, prefill and decode services. `--quick` measures a few
points of each (about a minute and a half on SmolLM2-135M, 2 cores).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.config import EngineConfig
from shared.errors import ConfigError
from shared.planner.profile import MachineShape, Profile
from shared.planner.profile_handoff import measure_handoff_sync
from shared.planner.profiler import SweepPlan, measure_engines

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("profile", help="measure prefill, decode and handoff costs here (input of `baton plan`)")
    p.add_argument("--model", default="smollm2-135m", help="alias, GGUF file or HF directory")
    p.add_argument("--out", type=Path, default=Path("profile.json"), help="where the profile goes")
    p.add_argument("--quick", action="store_true", help="a few points per sweep (for tests and a first look)")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch thread counts to measure engines at (default: 1 and the core count)")
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "ucxx", "tcp"],
                   help="kv_transfer's transport for the handoff sweep")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    machine = MachineShape.this_machine()
    threads = tuple(sorted(set(args.threads or (1, machine.cores))))
    if any(t < 1 or t > machine.cores for t in threads):
        raise ConfigError(f"--threads must be within 1..{machine.cores} (this machine's cores), got {threads}")
    plan = SweepPlan.quick(threads) if args.quick else SweepPlan(threads=threads)
    started = time.monotonic()
    config = EngineConfig(model=args.model, kv_cache_bytes=(1 << 30) if args.quick else (2 << 30),
                          max_model_len=4096, cache_dir=args.cache_dir)
    engines, identity = measure_engines(config, plan)
    block_size, budget, max_seqs = config.block_size, config.max_num_batched_tokens, config.max_num_seqs
    handoff_threads = min(threads)  # a prefill beside a decode: the fewer threads each gets
    logger.info("profile: handoff sweep through kv_transfer, prefill and decode services ...")
    handoff, kv_bytes_per_token = measure_handoff_sync(args.model, plan.handoff_lengths, plan.repeats,
                                                       handoff_threads, engines[handoff_threads], args.transport)
    profile = Profile(model=args.model, model_identity=identity, machine=machine, block_size=block_size,
                      kv_bytes_per_token=kv_bytes_per_token, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                      engines=engines, handoff=handoff, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                      notes="quick sweep" if args.quick else "")
    profile.save(args.out)
    logger.info("profile: wrote %s after %.0f s", args.out, time.monotonic() - started)
    print(args.out)
    return 0
