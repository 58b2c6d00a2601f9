"""Grammar-constrained decoding against unconstrained, and grammar fast-forward on against off, same run.

Two workloads on the served CPU path (the C++ kernels and layer loop), greedy, chat prompts:

- mask cost: every request writes long JSON strings (a schema whose only freedom is the text),
  with fast-forward off, against the same requests unconstrained (`ignore_eos`, as many tokens):
  output tokens/s of each and their ratio. What the grammar costs per token (bitmask fill,
  apply, state sync), not what it saves.
- fast-forward: a schema of many fixed keys (a contact card), constrained both times, fast-forward
  on against off: tokens/s and forward passes per request.

At batch 1 and 16; the configurations run in alternating rounds (`--repeats`), medians reported
with every run, so machine drift hits both. Writes JSON to bench/results/ and prints it last.

    python -m bench.structured [--model smollm2-135m] [--batch 1 16] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.engine import QUESTIONS, log, machine
from bench.results_file import write_results
from bench.serve_report import write_block
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.structured.spec import GrammarSpec
from shared.tokenizer import encode_prompt

# free text in four bounded strings (xgrammar 0.2.8 fails to compile one string bounded past ~100 characters
# through the pattern shared/structured/schema_fixes.py rewrites bounds into; such a schema is a 400)
LONG_TEXT = {"type": "object", "properties": {f"part_{i}": {"type": "string", "minLength": 50, "maxLength": 120}
                                              for i in range(4)},
             "required": [f"part_{i}" for i in range(4)], "additionalProperties": False}
CARD_KEYS = ["first_name", "last_name", "job_title", "company_name", "street_address", "city_name", "postal_code",
             "country_name", "phone_number", "email_address", "website_url", "favorite_color"]
CARD = {"type": "object", "properties": {k: {"type": "string", "maxLength": 16} for k in CARD_KEYS},
        "required": CARD_KEYS, "additionalProperties": False}


def engine_for(model: str, fast_forward: bool, fast_forward_max_batch: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, max_model_len=2048, kv_cache_bytes=256 << 20,
                                  grammar_fast_forward=fast_forward,
                                  grammar_fast_forward_max_batch=fast_forward_max_batch))


def timed(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, overlap: bool = True) -> dict[str, Any]:
    """One run on a cold prefix cache: tokens/s, engine steps (forward passes) for the batch, and the time
    spent building masks (on the worker beside the forward, or after it with `overlap` off) and waiting
    for them."""
    engine.pool.reset_prefix_cache()
    engine.runner.overlap_masks = overlap
    masks = engine.runner.masks
    build_s, wait_s = masks.build_s, masks.wait_s
    tokens: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
        steps += 1
    seconds = time.perf_counter() - t0
    num_tokens = sum(tokens.values())
    return {"seconds": seconds, "tokens": num_tokens, "tok_s": num_tokens / seconds, "steps": steps,
            "mean_tokens": num_tokens / len(prompts), "step_ms": 1e3 * seconds / steps,
            "mask_build_ms_per_step": 1e3 * (masks.build_s - build_s) / steps,
            "mask_wait_ms_per_step": 1e3 * (masks.wait_s - wait_s) / steps}


Config = tuple[LLMEngine, SamplingParams] | tuple[LLMEngine, SamplingParams, bool]  # (..., overlap masks)


def run_pair(name: str, runs: dict[str, list[dict[str, Any]]], configs: dict[str, Config],
             prompts: list[list[int]], repeats: int) -> dict[str, Any]:
    """Time each configuration `repeats` times in alternating rounds; medians and every run."""
    for rnd in range(repeats):
        for label, config in configs.items():
            engine, params, *overlap = config
            result = timed(engine, prompts, params, *overlap)
            runs.setdefault(label, []).append(result)
            log(f"{name} round {rnd + 1}/{repeats} {label}: {result['tok_s']:.1f} tok/s "
                f"({result['mean_tokens']:.0f} tokens a request, {result['step_ms']:.1f} ms a step, masks "
                f"{result['mask_build_ms_per_step']:.2f} ms built / {result['mask_wait_ms_per_step']:.2f} ms waited)")
    keys = ("tok_s", "step_ms", "mask_build_ms_per_step", "mask_wait_ms_per_step")
    return {label: {**{f"{k}_median": statistics.median(r[k] for r in rs) for k in keys}, "runs": rs}
            for label, rs in runs.items()}


def table(out: dict[str, Any]) -> str:
    """bench/README.md's block for one run (every figure from its JSON)."""
    lines = [f"Structured outputs ({out['model']}, greedy, chat prompts; medians of {out['repeats']} alternating "
             f"rounds, load average {out['loadavg_1m_before']:.1f} at the start; bench/structured.py):", "",
             "| batch | unconstrained tok/s | constrained tok/s | ratio | mask build / wait ms a step "
             "| masks after forward tok/s | card schema, fast-forward off tok/s "
             "| on tok/s | speedup | forced drafts | accepted |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["results"]:
        m, f = r["mask_cost"], r["fast_forward"]
        c = m["constrained"]
        lines.append(f"| {r['batch']} | {m['unconstrained']['tok_s_median']:.1f} | {c['tok_s_median']:.1f} "
                     f"| {r['constrained_over_unconstrained']:.3f} | {c['mask_build_ms_per_step_median']:.2f} / "
                     f"{c['mask_wait_ms_per_step_median']:.2f} of {c['step_ms_median']:.0f} "
                     f"| {m['constrained_masks_after_forward']['tok_s_median']:.1f} "
                     f"| {f['fast_forward_off']['tok_s_median']:.1f} "
                     f"| {f['fast_forward_on']['tok_s_median']:.1f} | {r['fast_forward_speedup']:.2f}x "
                     f"| {r['forced_drafts']} | {r['accepted_drafts']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch 1 only, one round (smoke run)")
    parser.add_argument("--fast-forward-max-batch", type=int, default=EngineConfig.grammar_fast_forward_max_batch,
                        help="the engines' grammar_fast_forward_max_batch (a large value measures fast-forward at "
                             "every batch)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite bench/README.md's table")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.repeats = [1], 1
    log(f"loading {args.model} (two engines: fast-forward off and on)")
    plain = engine_for(args.model, False, args.fast_forward_max_batch)
    forward = engine_for(args.model, True, args.fast_forward_max_batch)
    tok = plain.loaded.tokenizer
    long_text = GrammarSpec("json_schema", json.dumps(LONG_TEXT))
    card = GrammarSpec("json_schema", json.dumps(CARD))
    out: dict[str, Any] = {"bench": "structured", "model": args.model, "machine": machine(), "repeats": args.repeats,
                           "fast_forward_max_batch": args.fast_forward_max_batch,
                           "loadavg_1m_before": os.getloadavg()[0], "results": []}
    for batch in args.batch:
        questions = [f"{q} Answer in JSON." for q in (QUESTIONS * 4)[:batch]]
        prompts = [encode_prompt(tok, q, chat=True) for q in questions]
        warm = SamplingParams(max_tokens=8, temperature=0.0, structured=card)
        plain.generate(prompts[:1], warm), forward.generate(prompts[:1], warm)  # compile, warm up
        constrained = SamplingParams(max_tokens=160, temperature=0.0, structured=long_text)
        probe = plain.generate(prompts, constrained)
        num_tokens = max(1, int(statistics.median(len(r.token_ids) for r in probe)))
        free = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        mask = run_pair(f"batch {batch} mask cost", {}, {"unconstrained": (plain, free),
                                                         "constrained": (plain, constrained),
                                                         "constrained_masks_after_forward": (plain, constrained, False)},
                        prompts, args.repeats)
        card_params = SamplingParams(max_tokens=400, temperature=0.0, structured=card)
        ff = run_pair(f"batch {batch} fast-forward", {}, {"fast_forward_off": (plain, card_params),
                                                          "fast_forward_on": (forward, card_params)},
                      prompts, args.repeats)
        stats = forward.speculator.stats if forward.speculator is not None else None
        out["results"].append({
            "batch": batch,
            "mask_cost": mask,
            "constrained_over_unconstrained": mask["constrained"]["tok_s_median"]
            / mask["unconstrained"]["tok_s_median"],
            "fast_forward": ff,
            "fast_forward_speedup": ff["fast_forward_on"]["tok_s_median"] / ff["fast_forward_off"]["tok_s_median"],
            "forced_drafts": stats.num_forced_drafts if stats is not None else 0,
            "accepted_drafts": stats.num_accepted_tokens if stats is not None else 0,
        })
        r = out["results"][-1]
        log(f"batch {batch}: constrained {r['constrained_over_unconstrained']:.3f}x unconstrained; "
            f"fast-forward {r['fast_forward_speedup']:.2f}x")
    path = write_results(out, args.out, "structured", indent=1)
    log(f"wrote {path}")
    if not args.no_readme and not args.quick:
        write_block(Path(__file__).parent / "README.md", "structured", table(out))
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}))


if __name__ == "__main__":
    sys.exit(main())
