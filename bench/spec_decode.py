"""Speculative decoding: output tok/s, TPOT and acceptance length per proposer.

For each task (input-grounded: repeat or edit a given text; chat: open
questions), batch size (1 and 8) and method (none / ngram / draft / eagle /
eagle-tree, the same head drafting `--spec-tree` for its greedy requests):
greedy generation through the in-process engine, timed per request (TPOT =
time between a request's first and last token over the tokens in between),
output tokens/s over the whole batch, the mean acceptance length (tokens
emitted per verification step: accepted drafts + 1), the speedup over `none`
on the same loop, and the engine's idle ratio (gaps between executor steps over
the executor's time) with the synchronous loop and the zero-bubble loop (`--loops`;
draft and eagle always run the synchronous one). Greedy outputs are the same
for every method and loop, so each does the same work. Batch 1 runs the task's
prompts one after another. Writes JSON to bench/results/ and prints it as the
last line.

    python bench/spec_decode.py [--model smollm2-135m] [--batch 1 8] [--max-tokens 128] [--quick]
                                [--loops sync async] [--methods none ngram draft eagle]
                                [--eagle-head PATH]   (default: ~/.cache/baton/eagle/<model>.safetensors,
                                                       made by `baton train-draft`; eagle is skipped without it)
                                [--spec-disable-batch-size N]   (steps with more than N decoding run plainly)
                                [--spec-tree CHOICES]   (eagle-tree's tree, shared/spec/tree.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.models.loader import LoadedModel, load_model
from shared.ops.attention import paged_attention_ref
from shared.tokenizer import encode_prompt

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the spiral stairs, trimmed the wick and polished the great lens until it shone. Ships passing in the "
    "fog trusted its beam to guide them safely around the rocks below.",
    "To make fresh bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes until "
    "it is smooth and elastic, then let it rise in a warm place for an hour. Shape the loaf, let it rise again, "
    "and bake it in a hot oven for about forty minutes.",
    "Maria opened the small wooden box that her grandmother had left her. Inside she found a silver key, a faded "
    "photograph of a garden, and a letter written in careful handwriting. The letter asked her to visit the "
    "village where her grandmother was born and to open the gate at the end of the lane.",
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the members "
    "agreed to spend more on children's books and less on furniture. The final plan will be presented to the "
    "city council next month for approval.",
]
GROUNDED = [f"Repeat the following text exactly, without any changes:\n\n{p}" for p in PARAGRAPHS] + [
    f"Rewrite the following text, replacing every 'the' with 'a' and keeping everything else the same:\n\n{p}"
    for p in PARAGRAPHS
]
CHAT = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain why the sky is blue.",
    "How do airplanes fly?", "Give me a recipe for pancakes.", "What is machine learning?",
    "Why do we have seasons?", "Tell me a short story about a robot.",
]
TASKS = {"grounded": GROUNDED, "chat": CHAT}
# drafts per step: ngram copies long runs cheaply; model drafts cost a forward per token
NUM_SPEC_TOKENS = {"ngram": 5, "draft": 2, "eagle": 3, "eagle-tree": 3}  # eagle-tree: its sampled requests' chains
# eagle-tree's default: the first guess's branch to depth 4, the second and third guesses, and the second
# guess after each of the first two (8 drafts)
DEFAULT_TREE = "0;1;2;0.0;0.1;1.0;0.0.0;0.0.0.0"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Timing:
    num_tokens: int
    elapsed_s: float
    tpot_s: list[float]  # per request with at least two tokens


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> Timing:
    """Generate for `prompts` together, noting when each request's first and last token came out."""
    ids = [f"b{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts = dict.fromkeys(ids, 0)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            counts[out.request_id] += len(out.new_token_ids)
    elapsed = time.perf_counter() - t0
    tpot = [(last[i] - first[i]) / (counts[i] - 1) for i in ids if counts[i] > 1]
    return Timing(sum(counts.values()), elapsed, tpot)


def measure(engine: LLMEngine, prompts: list[list[int]], batch: int, params: SamplingParams) -> Timing:
    """Batch 1: the prompts one after another; otherwise all `batch` prompts together."""
    groups = [[p] for p in prompts] if batch == 1 else [prompts[:batch]]
    parts = [run_batch(engine, g, params) for g in groups]
    return Timing(sum(p.num_tokens for p in parts), sum(p.elapsed_s for p in parts),
                  [t for p in parts for t in p.tpot_s])


def make_engine(loaded: LoadedModel, method: str, loop: str, args: argparse.Namespace) -> LLMEngine:
    kw: dict[str, Any] = dict(model=args.model, max_model_len=2048, kv_cache_bytes=256 << 20,
                              async_scheduling=loop == "async")
    if method != "none":
        kw.update(spec_method=method.removesuffix("-tree"), num_speculative_tokens=NUM_SPEC_TOKENS[method],
                  spec_disable_batch_size=args.spec_disable_batch_size)
    if method.startswith("eagle"):
        kw["spec_eagle_head"] = args.eagle_head
    if method == "eagle-tree":
        kw["spec_tree"] = args.spec_tree
    if method == "draft":
        kw["spec_draft_num_layers"] = args.draft_layers
    return LLMEngine(EngineConfig(**kw), loaded=loaded)


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "commit": commit,
            "load_average_1m": os.getloadavg()[0]}


def bench_method(loaded: LoadedModel, method: str, loop: str, args: argparse.Namespace,
                 prompts: dict[str, list[list[int]]], params: SamplingParams) -> list[dict[str, Any]]:
    engine = make_engine(loaded, method, loop, args)
    if loop == "async" and not engine.async_scheduling:
        log(f"{method}: no zero-bubble loop for this proposer (its synchronous rows stand)")
        engine.close()
        return []
    engine.generate(prompts["chat"][:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    rows = []
    for task, task_prompts in prompts.items():
        for batch in args.batch:
            before = engine.speculator.stats if engine.speculator else None
            drafts0 = (before.num_verifications, before.num_accepted_tokens) if before else (0, 0)
            clock = engine.runner.clock
            busy0, idle0 = clock.busy_s, clock.idle_s
            t = measure(engine, task_prompts[: max(batch, args.batch1_prompts)] if batch == 1 else task_prompts,
                        batch, params)
            row: dict[str, Any] = {
                "task": task, "batch": batch, "method": method, "loop": loop, "output_tokens": t.num_tokens,
                "tok_s": t.num_tokens / t.elapsed_s,
                "tpot_ms": 1000 * sum(t.tpot_s) / max(len(t.tpot_s), 1),
                "num_speculative_tokens": NUM_SPEC_TOKENS.get(method, 0),
                "idle_ratio": (clock.idle_s - idle0) / max(clock.idle_s - idle0 + clock.busy_s - busy0, 1e-9),
            }
            if before is not None:
                num_verifications = before.num_verifications - drafts0[0]
                accepted = before.num_accepted_tokens - drafts0[1]
                row["mean_acceptance_length"] = 1 + accepted / num_verifications if num_verifications else None
            rows.append(row)
            log(f"{task:8s} batch {batch}: {method:5s} {loop:5s} {row['tok_s']:6.1f} tok/s, "
                f"TPOT {row['tpot_ms']:6.1f} ms, idle {row['idle_ratio']:.3f}, "
                f"acceptance {row.get('mean_acceptance_length')}")
    engine.close()
    engine.check_no_leaks()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["none", "ngram", "draft", "eagle", "eagle-tree"])
    parser.add_argument("--loops", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    parser.add_argument("--eagle-head", type=Path)
    parser.add_argument("--spec-disable-batch-size", type=int, help="steps with more requests decoding run plainly")
    parser.add_argument("--spec-tree", default=DEFAULT_TREE, help="eagle-tree's draft tree (rank paths)")
    parser.add_argument("--draft-layers", type=int, default=4, help="draft = the target's first N layers")
    parser.add_argument("--batch1-prompts", type=int, default=4, help="prompts run one by one at batch 1")
    parser.add_argument("--quick", action="store_true", help="48 new tokens, 2 prompts at batch 1")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.batch1_prompts = 48, 2
    args.eagle_head = args.eagle_head or DEFAULT_CACHE_DIR / "eagle" / f"{args.model}.safetensors"
    methods = list(args.methods)
    if not args.eagle_head.is_file():
        for m in [m for m in methods if m.startswith("eagle")]:
            log(f"no EAGLE head at {args.eagle_head} (run `baton train-draft --out {args.eagle_head}`): skipping {m}")
            methods.remove(m)

    log(f"loading {args.model} ...")
    loaded = load_model(args.model, paged_attention_ref, max_model_len=2048)
    chat = loaded.chat_template is not None
    prompts = {task: [encode_prompt(loaded.tokenizer, p, chat=chat) for p in texts] for task, texts in TASKS.items()}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = [row for loop in args.loops for method in methods
            for row in bench_method(loaded, method, loop, args, prompts, params)]
    base = {(r["task"], r["batch"], r["loop"]): r["tok_s"] for r in rows if r["method"] == "none"}
    for r in rows:
        if (r["task"], r["batch"], r["loop"]) in base:
            r["speedup_vs_none"] = r["tok_s"] / base[(r["task"], r["batch"], r["loop"])]
        sync = [b for b in rows if b["loop"] == "sync" and (b["task"], b["batch"], b["method"]) ==
                (r["task"], r["batch"], r["method"])]
        if r["loop"] == "async" and sync:
            r["speedup_vs_sync_loop"] = r["tok_s"] / sync[0]["tok_s"]
    result = {
        "bench": "spec_decode", "model": args.model, "max_tokens": args.max_tokens, "greedy": True,
        "draft_layers": args.draft_layers, "spec_disable_batch_size": args.spec_disable_batch_size,
        "eagle_head": str(args.eagle_head) if any(m.startswith("eagle") for m in methods) else None,
        "spec_tree": args.spec_tree if "eagle-tree" in methods else None,
        "machine": machine(), "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"spec_decode-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    log(f"wrote {path}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
