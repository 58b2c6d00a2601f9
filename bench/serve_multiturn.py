"""A multi-turn chat workload with shared prefixes: fixed-seed conversations, each turn sent after the last.

    templates (shared system prompts) ──► conversations: template + user turns
    conversation c starts at a Poisson arrival; turn t sends system + (user, reply) × t + user_t
    ──► [TurnRecord ...]: what the client saw of every turn, with the prompt tokens the server says
        came from a prefix cache (usage.prompt_tokens_details.cached_tokens)

Two sources of prefix reuse, as in agentic and chat traffic: conversations that share a template, and
each later turn of one conversation repeating everything before it. Replies are exact lengths
(`ignore_eos`, greedy), so every policy sees the same token counts. Bounded: a conversation count and a
wall-clock timeout, after which turns still open are cancelled and count as failed.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from bench.serve_load import RequestSpec, client_session, launch_arrivals, send_one
from bench.serve_stats import SLO, RequestRecord, percentile, summarize

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "da", "zu", "ho", "ri", "mo", "te", "bi")


@dataclass(frozen=True)
class MultiTurnPlan:
    num_conversations: int
    num_turns: int  # turns per conversation
    num_templates: int  # distinct shared system prompts
    template_words: int
    user_words: int  # words per user message
    output_tokens: int  # tokens per reply
    # False: conversation c uses template c % num_templates. True: a seeded uniform draw, so the order in
    # which templates recur has no cycle (a cycle longer than an LRU cache misses on every reuse)
    random_templates: bool = False


@dataclass(frozen=True)
class Conversation:
    system: str
    user_turns: tuple[str, ...]


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    record: RequestRecord


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


def conversations(plan: MultiTurnPlan, seed: int) -> list[Conversation]:
    """Fixed-seed conversations; conversation c uses template c % num_templates, or a seeded draw."""
    rng = random.Random(seed)
    templates = [f"You are assistant {i}. " + _words(rng, plan.template_words) for i in range(plan.num_templates)]
    chosen = [rng.randrange(plan.num_templates) if plan.random_templates else c % plan.num_templates
              for c in range(plan.num_conversations)]
    return [Conversation(templates[t], tuple(_words(rng, plan.user_words) for _ in range(plan.num_turns)))
            for t in chosen]


async def _run_conversation(client: aiohttp.ClientSession, model: str, index: int, conv: Conversation,
                            output_tokens: int, timeout_s: float, records: list[TurnRecord]) -> None:
    messages = [{"role": "system", "content": conv.system}]
    for turn, user in enumerate(conv.user_turns):
        messages.append({"role": "user", "content": user})
        spec = RequestSpec("/v1/chat/completions", {
            "messages": list(messages), "max_tokens": output_tokens, "min_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0.0})
        record = await send_one(client, model, spec, timeout_s)
        records.append(TurnRecord(index, turn, record))
        if not record.ok:
            return  # the conversation cannot go on without its reply; its later turns count as failed
        messages.append({"role": "assistant", "content": record.text})


async def run_conversations(base_url: str, model: str, convs: Sequence[Conversation], output_tokens: int, *,
                            rate: float, seed: int = 0, timeout_s: float = 300.0
                            ) -> tuple[list[TurnRecord], float]:
    """Start conversations at Poisson arrivals of `rate` per second; each runs its turns back to back.
    Returns every turn's record (failed and never-sent turns included) and the wall time."""
    rng = random.Random(seed)
    records: list[TurnRecord] = []
    loop = asyncio.get_running_loop()
    async with client_session(base_url, len(convs), timeout_s) as client:
        start = loop.time()
        await launch_arrivals([functools.partial(_run_conversation, client, model, i, conv, output_tokens, timeout_s,
                                                 records) for i, conv in enumerate(convs)], rate, rng, timeout_s)
        duration_s = loop.time() - start
    sent = {(r.conversation, r.turn) for r in records}
    for i, conv in enumerate(convs):  # turns never sent (an earlier turn failed, or the timeout) are failures
        records += [TurnRecord(i, t, RequestRecord(sent_s=0.0, error="not sent"))
                    for t in range(len(conv.user_turns)) if (i, t) not in sent]
    return records, duration_s


def summarize_turns(turns: Sequence[TurnRecord], duration_s: float, slo: SLO) -> dict[str, float]:
    """summarize()'s figures plus prefix hit rates (all turns, later turns only) and goodput at this rate:
    requests meeting the SLO per second."""
    records = [t.record for t in turns]
    out = summarize(records, duration_s, slo)
    ok = [t for t in turns if t.record.ok]
    for name, subset in (("prefix_hit_rate", ok), ("prefix_hit_rate_first_turns", [t for t in ok if t.turn == 0]),
                         ("prefix_hit_rate_later_turns", [t for t in ok if t.turn > 0])):
        prompt = sum(t.record.prompt_tokens for t in subset)
        out[name] = sum(t.record.cached_tokens for t in subset) / prompt if prompt else 0.0
    out["good_req_s"] = sum(slo.met_by(r) for r in records) / duration_s if duration_s > 0 else 0.0
    out["mean_prompt_tokens"] = sum(t.record.prompt_tokens for t in ok) / len(ok) if ok else 0.0
    out["p90_prompt_tokens"] = percentile([t.record.prompt_tokens for t in ok], 90)
    return out
