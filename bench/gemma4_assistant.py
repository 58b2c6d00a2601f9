"""The gemma4_assistant drafter: output tok/s with it on and off, and its acceptance length, same run.

A tiny random Gemma 4 checkpoint (`baton make-tiny gemma4`, every text feature)
and a random assistant for it (`baton make-tiny gemma4-assistant`), cached
under ~/.cache/baton/bench-gemma4-assistant. With random weights the drafts are
rarely right: the acceptance length is a check that the mechanics work (the
drafter runs, verification accepts what matches), not a measure of a trained
drafter, and tok/s with it on pays the drafting without its benefit. Both
engines are built once and timed in alternating rounds (`--repeats`); greedy
outputs must be identical. Writes JSON to bench/results/ and prints it last.

    python bench/gemma4_assistant.py [--batch 1 4] [--new-tokens 64] [--repeats 3] [--hidden-size 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.models.gemma4.tiny import TinyGemma4, write_assistant_checkpoint, write_checkpoint
from shared.models.loader import resolve_model


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkpoints(hidden_size: int) -> tuple[Path, Path]:
    root = DEFAULT_CACHE_DIR / "bench-gemma4-assistant" / f"h{hidden_size}"
    target, assistant = root / "target", root / "assistant"
    if not (target / "config.json").exists():
        log(f"writing the tiny target and assistant under {root}")
        opts = TinyGemma4(num_layers=6, hidden_size=hidden_size, moe=True, k_eq_v=True, kv_shared_layers=2,
                          ple_size=32, sliding_window=128)
        write_checkpoint(target, opts, resolve_model("gemma3-270m"))
        write_assistant_checkpoint(assistant, target, hidden_size=hidden_size // 2)
    return target, assistant


def timed(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in results) / seconds, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    target, assistant = checkpoints(args.hidden_size)
    base = dict(model=str(target), max_model_len=1024, kv_cache_bytes=64 << 20, async_scheduling=False)
    off = LLMEngine(EngineConfig(**base))  # type: ignore[arg-type]
    on = LLMEngine(EngineConfig(**base, spec_method="gemma4_assistant", spec_draft_model=str(assistant),  # type: ignore[arg-type]
                                num_speculative_tokens=args.num_speculative_tokens))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0)
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        prompts = [torch.randint(3, 262_144, (48,), generator=gen).tolist() for _ in range(batch)]
        timed(off, prompts, params), timed(on, prompts, params)  # warm-up
        runs: dict[str, list[float]] = {"off": [], "on": []}
        before = on.speculator.stats.num_draft_tokens, on.speculator.stats.num_accepted_tokens, \
            on.speculator.stats.num_verifications  # type: ignore[union-attr]
        for _ in range(args.repeats):
            tps_off, out_off = timed(off, prompts, params)
            tps_on, out_on = timed(on, prompts, params)
            assert out_on == out_off, "greedy outputs differ with the drafter on"
            runs["off"].append(tps_off)
            runs["on"].append(tps_on)
        s = on.speculator.stats  # type: ignore[union-attr]
        drafts, accepted, verifications = (s.num_draft_tokens - before[0], s.num_accepted_tokens - before[1],
                                           s.num_verifications - before[2])
        row = {"batch": batch, "tok_s_off": statistics.median(runs["off"]), "tok_s_on": statistics.median(runs["on"]),
               "runs": runs, "draft_tokens": drafts, "accepted_tokens": accepted,
               "acceptance_length": 1 + accepted / max(verifications, 1)}
        row["speedup_on_over_off"] = row["tok_s_on"] / row["tok_s_off"]
        log(f"batch {batch}: off {row['tok_s_off']:.1f} tok/s, on {row['tok_s_on']:.1f} tok/s "
            f"({row['speedup_on_over_off']:.2f}x), acceptance length {row['acceptance_length']:.3f}")
        rows.append(row)
    off.close()
    on.close()
    result = {"bench": "gemma4_assistant", "target_hidden_size": args.hidden_size, "new_tokens": args.new_tokens,
              "num_speculative_tokens": args.num_speculative_tokens, "threads": torch.get_num_threads(), "rows": rows}
    out = Path(__file__).parent / "results" / f"gemma4_assistant-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
