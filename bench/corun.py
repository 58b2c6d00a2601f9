"""Two engines stepping at once on one host, each on its own share of the cores: how much each slows the other.

The simulator (shared/planner/sim_engine.py `Host`) times a step by the profile's curves at its thread count
and shares cores between engines. On a 2-core host a split stack's prefill and decode each run on one core
while both have work, and a plan_validate run (2026-11-29) measured both slower then than their one-thread
curves: prompts reaching prefill beside a decoding stream took 1.2-1.9x their predicted time, and the stream's
steps meanwhile 20-25 ms against 17. The cores are not shared there; what is, is the memory bus and the last
level cache (an fp32 SmolLM2 decode step reads all 540 MB of weights). This measures it on the real engine:

    decode worker:  one request decoding from a 256-token prompt, steps timed (restarted every 64 tokens)
    prefill worker: 256-token prompts, one a step, max_tokens 1
    each alone, then both at once (separate processes, one torch thread each), rounds in turn

and reports each worker's rate together against alone (`corun_speed`), which the simulator takes as
SimOptions.corun_speed.

    .venv/bin/python -m bench.corun [--seconds 8] [--rounds 2] [--threads 1] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.results_file import write_results

PROMPT_TOKENS = 256
DECODE_RESTART = 64  # decode tokens before the request starts again (context stays near the prompt's)


def worker(role: str, seconds: float, threads: int, dtype: str, quantization: str, model: str) -> None:
    """Load, say `ready`, wait for `go` on stdin, then step for `seconds`; print the rate (steps per second)."""
    import random

    import torch

    from bench.layer_loop import end_requests
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.request import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, quantization=quantization, max_model_len=2048))
    vocab = engine.loaded.spec.vocab_size
    rng = random.Random(0 if role == "decode" else 1)
    count = 0  # requests so far: fresh ids, and fresh prompts (no prefix-cache hits)

    def add(max_tokens: int) -> str:
        nonlocal count
        rid = f"{role}-{count}"
        count += 1
        engine.add_request(rid, [rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return rid

    def prefill_once() -> None:
        add(1)
        while engine.has_unfinished():  # one step: the prompt, and its one token
            engine.step()

    def decode_for(until: float) -> int:
        steps = 0
        while time.perf_counter() < until:
            rid = add(DECODE_RESTART + 1)
            engine.step()  # its prefill, not counted
            while engine.has_unfinished() and time.perf_counter() < until:
                engine.step()
                steps += 1
            end_requests(engine, [rid])
        return steps

    for _ in range(2):  # warm: first-call costs stay out
        prefill_once()
    decode_for(time.perf_counter() + 0.5)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    if role == "decode":
        n = decode_for(started + seconds)
    else:
        n = 0
        while time.perf_counter() < started + seconds:
            prefill_once()
            n += 1
    print(f"{n / (time.perf_counter() - started):.4f}", flush=True)


def run(roles: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Each role's rate, all started together once every worker has loaded."""
    procs = {role: subprocess.Popen([sys.executable, "-m", "bench.corun", "--worker", role, "--seconds",
                                     str(args.seconds), "--threads", str(args.threads), "--dtype", args.dtype,
                                     "--quantization", args.quantization, "--model", args.model],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for role in roles}
    for p in procs.values():
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return {role: float(p.communicate()[0].strip()) for role, p in procs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--worker", choices=("decode", "prefill"))
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seconds, args.threads, args.dtype, args.quantization, args.model)
        return 0
    rounds = []
    for r in range(args.rounds):
        alone = {**run(["decode"], args), **run(["prefill"], args)}
        together = run(["decode", "prefill"], args)
        rounds.append({"alone": alone, "together": together,
                       "speed": {k: round(together[k] / alone[k], 3) for k in alone}})
        print(f"round {r + 1}: decode {alone['decode']:.1f} -> {together['decode']:.1f} steps/s, prefill "
              f"{alone['prefill']:.2f} -> {together['prefill']:.2f} prompts/s together", file=sys.stderr, flush=True)
    speed = {k: round(statistics.median(r["speed"][k] for r in rounds), 3) for k in ("decode", "prefill")}
    from bench.engine import machine

    result = {"bench": "corun", "machine": machine(), "model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "threads": args.threads, "seconds": args.seconds, "prompt_tokens": PROMPT_TOKENS, "rounds": rounds,
              "corun_speed": speed}
    print(f"wrote {write_results(result, args.out_dir, 'corun')}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
