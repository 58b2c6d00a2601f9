"""kv_transfer's prefix pool under LRU and LFU eviction: hit rates on a synthetic multi-turn chat trace.

The trace (seeded): conversations open at random times on one of a few system
prompts (Zipf popularity) and go on for a geometric number of turns with a
random think time between them; each turn's prompt is the system prompt, every
earlier user message and reply, and the new user message. Requests are
replayed in time order through the real `HandoffStore` (reserve, commit, claim,
release: what prefill and decode do), its slots keyed as prefill keys them
(`unit_hashes` over a Gemma 4 hybrid layout: a full-attention group and a
sliding group that hands off only its window), at pool sizes cut as fractions
of the trace's distinct units. Replies are not in the pool (decode writes
them, prefill never publishes them): a turn can reuse its previous prompt, not
the reply after it.

    unit hit   units found in the pool / hashed units asked for (what the policy decides)
    reuse      prompt tokens a prefill may read from the pool instead of computing (`usable_pool_prefix`,
               whole blocks) / prompt tokens. A prefix of n blocks needs the sliding group's window before
               block n, and a handoff only asks the pool for the units of its own window (the last 1024
               tokens of its prompt): past the window, a later turn's prompt can reuse nothing, whatever the
               pool holds (the 100% row: nothing is ever evicted)

Each policy replays the same traces (one per seed); the figures are their mean
and range. Writes JSON to bench/results/ and the table into bench/README.md.

    python -m bench.kv_offload_policy [--seeds 0 1 2] [--conversations 150] [--fractions 0.05 0.1 0.2 0.4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results
from bench.serve_report import write_block
from services.kv_transfer.slots import EVICTION_POLICIES, make_policy
from services.kv_transfer.store import HandoffStore
from shared.engine.block_pool import hash_prefix_blocks
from shared.kv.layout import KVLayout
from shared.kv.remote import HandoffResult, HandoffSpec, SlotSpace, unit_hashes, usable_pool_prefix
from shared.models.gemma4.published import published_text_config
from shared.models.gemma4.spec import gemma4_spec

BLOCK_SIZE = 16
MODEL = "gemma-4-26B-A4B"
RESULT = HandoffResult(first_token_id=0, first_logprobs=None)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class TraceShape:
    num_conversations: int = 150
    num_system_prompts: int = 6
    system_tokens: tuple[int, int] = (200, 600)
    user_tokens: tuple[int, int] = (20, 150)
    reply_tokens: tuple[int, int] = (50, 300)
    continue_prob: float = 0.75  # another turn after this one (geometric turns, mean 4)
    max_turns: int = 12
    arrival_gap_s: float = 20.0  # mean time between conversations opening
    think_time_s: float = 60.0  # mean time between a reply and the next turn


def make_trace(shape: TraceShape, seed: int) -> list[list[int]]:
    """The prompts of every request, in arrival order."""
    rng = random.Random(seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(3, 262_144) for _ in range(rng.randint(*bounds))]

    systems = [tokens(shape.system_tokens) for _ in range(shape.num_system_prompts)]
    popularity = [1 / (i + 1) ** 1.1 for i in range(shape.num_system_prompts)]
    events: list[tuple[float, list[int]]] = []
    start_s = 0.0
    for _ in range(shape.num_conversations):
        start_s += rng.expovariate(1 / shape.arrival_gap_s)
        history = list(rng.choices(systems, popularity)[0])
        at_s = start_s
        for turn in range(shape.max_turns):
            history += tokens(shape.user_tokens)
            events.append((at_s, list(history)))
            history += tokens(shape.reply_tokens)
            at_s += rng.expovariate(1 / shape.think_time_s)
            if turn + 1 == shape.max_turns or rng.random() > shape.continue_prob:
                break
    events.sort(key=lambda e: e[0])
    return [prompt for _, prompt in events]


def hybrid_layout() -> KVLayout:
    """The published MoE's KV layer geometry (sliding window 1024, K=V full layers), one block per group."""
    spec = gemma4_spec(published_text_config(MODEL), 262_144)
    return KVLayout.of(spec.kv_layers, 1, BLOCK_SIZE, torch.bfloat16)


def request_spec(base: KVLayout, handoff_id: str, prompt: list[int]) -> HandoffSpec:
    """What prefill reserves for `prompt` (services/prefill/server.py's `_spec`)."""
    layout = replace(base, num_blocks=len(base.handoff_units(len(prompt))), group_blocks=())
    hashes = unit_hashes(layout, hash_prefix_blocks(prompt, BLOCK_SIZE), len(prompt))
    return HandoffSpec(handoff_id, handoff_id, MODEL, layout, prompt, hashes, 0)


async def replay(prompts: list[list[int]], base: KVLayout, policy: str, num_slots: int) -> dict[str, float]:
    space = SlotSpace("bench", 0, base.slot_nbytes, num_slots)
    store = HandoffStore(base.slot_nbytes * num_slots, space, lease_timeout_s=60.0, claim_timeout_s=60.0,
                         policy=make_policy(policy))
    reused = total = unit_hits = units = 0
    for i, prompt in enumerate(prompts):
        spec = request_spec(base, f"r{i}", prompt)
        slots = store.reserve(spec)
        hashed = len(spec.block_hashes)
        units += hashed
        unit_hits += sum(slots.present[:hashed])
        reused += usable_pool_prefix(spec.layout, slots.present, len(prompt), len(prompt) // BLOCK_SIZE) * BLOCK_SIZE
        total += len(prompt)
        store.commit(spec.handoff_id, RESULT)
        await store.claim(spec.handoff_id)
        store.release(spec.handoff_id)
    store.check_no_leaks()
    return {"reuse": reused / total, "unit_hit_rate": unit_hits / units}


def distinct_units(prompts: list[list[int]], base: KVLayout) -> tuple[int, int]:
    """(distinct hashed units over the trace, the most units one request pins)."""
    seen: set[bytes] = set()
    widest = 0
    for prompt in prompts:
        spec = request_spec(base, "probe", prompt)
        seen.update(spec.block_hashes)
        widest = max(widest, spec.num_blocks)
    return len(seen), widest


def readme_table(result: dict[str, Any]) -> str:
    policies = result["policies"]
    lines = [f"Prefix-pool reuse on a synthetic multi-turn chat trace (`bench/kv_offload_policy.py`, "
             f"{result['trace']['num_conversations']} conversations, {result['mean_requests']:.0f} requests, "
             f"seeds {result['seeds']}; {MODEL}'s hybrid layout, block {BLOCK_SIZE}); reuse = prompt tokens a "
             "prefill may read from the pool, mean (min-max) over the seeds:", "",
             "| pool (of distinct units) | slots | " + " | ".join(f"{p} reuse" for p in policies) + " | "
             + " | ".join(f"{p} unit hits" for p in policies) + " | lfu / lru reuse |",
             "|---|---|" + "---|" * (2 * len(policies) + 1)]
    def cell(runs: list[float]) -> str:
        return f"{statistics.mean(runs):.1%} ({min(runs):.1%}-{max(runs):.1%})"

    for row in result["rows"]:
        ratio = statistics.mean(row["lfu"]["reuse"]) / max(statistics.mean(row["lru"]["reuse"]), 1e-9)
        lines.append(f"| {row['fraction']:.0%} | {row['mean_slots']:.0f} | "
                     + " | ".join(cell(row[p]["reuse"]) for p in policies) + " | "
                     + " | ".join(cell(row[p]["unit_hit_rate"]) for p in policies) + f" | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--conversations", type=int, default=150)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4, 1.0],
                        help="pool sizes as fractions of the distinct units (1.0: nothing is ever evicted)")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    shape = TraceShape(num_conversations=args.conversations)
    base = hybrid_layout()
    policies = sorted(EVICTION_POLICIES, key=lambda p: p != "lru")
    rows: list[dict[str, Any]] = [{"fraction": f, "slots": [], **{p: {"reuse": [], "unit_hit_rate": []}
                                                                    for p in policies}} for f in args.fractions]
    num_requests = []
    for seed in args.seeds:
        prompts = make_trace(shape, seed)
        num_requests.append(len(prompts))
        distinct, widest = distinct_units(prompts, base)
        for row in rows:
            num_slots = max(int(row["fraction"] * distinct), widest)
            row["slots"].append(num_slots)
            for policy in policies:
                got = asyncio.run(replay(prompts, base, policy, num_slots))
                for metric, value in got.items():
                    row[policy][metric].append(value)
                log(f"seed {seed}, pool {row['fraction']:.0%} ({num_slots} slots), {policy}: "
                    f"reuse {got['reuse']:.1%}, unit hits {got['unit_hit_rate']:.1%}")
    for row in rows:
        row["mean_slots"] = statistics.mean(row["slots"])
    result = {"bench": "kv_offload_policy", "model_layout": MODEL, "block_size": BLOCK_SIZE, "seeds": args.seeds,
              "trace": vars(shape) | {"system_tokens": list(shape.system_tokens)}, "policies": policies,
              "requests": num_requests, "mean_requests": statistics.mean(num_requests), "rows": rows}
    out = write_results(result, Path(__file__).parent / "results", "kv_offload_policy", indent=1,
                        default=list)
    log(f"wrote {out}")
    if not args.no_readme:
        write_block(Path(__file__).parent / "README.md", "kv_offload_policy", readme_table(result))
    print(json.dumps(result, default=list))


if __name__ == "__main__":
    main()
