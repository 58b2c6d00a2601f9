"""OpenAI-API load generation: fixed-seed prompt sets, Poisson arrivals or a concurrency cap, streaming.

    prompt set ──► [RequestSpec ...] ──► run_load(rate | concurrency) ──► [RequestRecord ...]

Every request streams (`stream: true`, `stream_options.include_usage`) so the
arrival of each chunk with text is timed; the output token count comes from
the server's usage report. Random-token prompts are sent as token ids to
`/v1/completions` with `ignore_eos` so input and output lengths are exact on
every server; the chat set goes to `/v1/chat/completions` and stops where the
model stops (at most `max_tokens`). Every run is bounded: a request count and
a wall-clock timeout, after which requests still open are cancelled and
counted as failed.

The client is aiohttp (its HTTP parser is C; vLLM's benchmark_serving uses it too) because it runs on
the cores it measures: with httpx (pure-Python HTTP/1.1 framing and line splitting) this client spent
0.6-0.75 ms of CPU per streamed token at one stream, 8% of an int8 decode step, and every peer served
through it paid that on its own cores (bench/client_cost.py measures both clients).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.serve_stats import RequestRecord

CHAT_QUESTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Write a haiku about the sea.",
    "Explain why the sky is blue to a ten-year-old.",
    "Name three famous painters and one work by each.",
    "How do airplanes stay in the air?",
    "Give me a simple recipe for pancakes.",
    "What is machine learning? Answer in a short paragraph.",
    "Describe a cat to someone who has never seen one.",
    "Why do we have seasons on Earth?",
    "What are prime numbers? Give a few examples.",
    "Tell me a short story about a robot who learns to paint.",
    "How does a computer store numbers in memory?",
    "What is the tallest mountain in the world and how tall is it?",
    "Summarize the water cycle in a few sentences.",
    "What makes a good friend?",
    "How do bees make honey?",
    "Suggest three names for a bakery that sells bread and coffee.",
    "What should I pack for a weekend hiking trip?",
    "Explain the difference between weather and climate.",
    "Write a polite email asking a colleague to review my report.",
    "Why is exercise good for your health?",
    "How do I make a cup of green tea?",
    "What is the difference between a virus and a bacterium?",
    "List five tips for learning a new language.",
]
SYSTEM_PROMPT = "You are a helpful, concise assistant."


@dataclass(frozen=True)
class RequestSpec:
    """One request of a prompt set: where it goes and its JSON body (without `model` and `stream`)."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]


def random_token_set(
    num_requests: int, input_len: int, output_len: int, vocab_ids: Sequence[int], seed: int
) -> list[RequestSpec]:
    """Prompts of exactly `input_len` token ids drawn uniformly from `vocab_ids`, exactly `output_len` out."""
    rng = random.Random(seed)
    return [
        RequestSpec("/v1/completions", {
            "prompt": [rng.choice(vocab_ids) for _ in range(input_len)], "max_tokens": output_len,
            "min_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
        })
        for _ in range(num_requests)
    ]


def mixed_set(
    num_requests: int, shapes: Sequence[tuple[int, int]], vocab_ids: Sequence[int], seed: int
) -> list[RequestSpec]:
    """Random-token requests whose (input_len, output_len) is drawn from `shapes` with a fixed seed."""
    rng = random.Random(seed)
    specs = []
    for i in range(num_requests):
        input_len, output_len = shapes[rng.randrange(len(shapes))]
        specs += random_token_set(1, input_len, output_len, vocab_ids, seed * 100_003 + i)
    return specs


def chat_set(num_requests: int, max_tokens: int, seed: int) -> list[RequestSpec]:
    """Short real questions through the chat template, greedy, ending where the model ends."""
    rng = random.Random(seed)
    return [
        RequestSpec("/v1/chat/completions", {
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": rng.choice(CHAT_QUESTIONS)}],
            "max_tokens": max_tokens, "temperature": 0.0,
        })
        for _ in range(num_requests)
    ]


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


def _read_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.output_tokens = int(usage["completion_tokens"])
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def client_session(base_url: str, connections: int, timeout_s: float) -> aiohttp.ClientSession:
    """A session for `send_one`: `connections` at most open at once, every request bounded by `timeout_s`."""
    return aiohttp.ClientSession(base_url=base_url, connector=aiohttp.TCPConnector(limit=max(connections, 1)),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def send_one(session: aiohttp.ClientSession, model: str, spec: RequestSpec,
                   timeout_s: float) -> RequestRecord:
    """Stream one request, timing every chunk that carries text."""
    body = {**spec.body, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    record = RequestRecord(sent_s=time.perf_counter())
    num_chunks = 0
    try:
        async with session.post(spec.path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return record
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                text = _chunk_text(chunk)
                if text:
                    record.token_times_s.append(time.perf_counter())
                    record.text += text
                    num_chunks += 1
                if chunk.get("usage"):
                    _read_usage(record, chunk["usage"])
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if not record.error and record.output_tokens == 0:
        record.output_tokens = num_chunks
    return record


async def run_load(
    base_url: str, model: str, specs: Sequence[RequestSpec], *, rate: float | None = None,
    concurrency: int | None = None, seed: int = 0, timeout_s: float = 300.0,
) -> tuple[list[RequestRecord], float]:
    """Send `specs` with Poisson arrivals at `rate` req/s (None: all at once), at most `concurrency` open.

    Returns the records in send order and the wall time from the first send to
    the last finish. Requests still open at `timeout_s` are cancelled and fail.
    """
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or len(specs))
    records = [RequestRecord(sent_s=0.0, error="unfinished at the run timeout") for _ in specs]

    async with client_session(base_url, concurrency or len(specs), timeout_s) as session:
        async def one(i: int, spec: RequestSpec) -> None:
            async with limit:
                records[i] = await send_one(session, model, spec, timeout_s)

        start = time.perf_counter()
        await launch_arrivals([functools.partial(one, i, spec) for i, spec in enumerate(specs)], rate, rng,
                              timeout_s)
        end = min(time.perf_counter(), start + timeout_s)
    return records, end - start


async def launch_arrivals(jobs: Sequence[Callable[[], Awaitable[None]]], rate: float | None, rng: random.Random,
                          timeout_s: float) -> None:
    """Start each job after a Poisson gap at `rate` per second (None: all at once) and wait for them all;
    whatever is still running at `timeout_s` is cancelled (its record says so)."""
    tasks: list[asyncio.Task[None]] = []
    try:
        async with asyncio.timeout(timeout_s):
            for i, job in enumerate(jobs):
                tasks.append(asyncio.create_task(job()))
                if rate is not None and i + 1 < len(jobs):
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
    except TimeoutError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def warm_up(base_url: str, model: str, vocab_ids: Sequence[int], timeout_s: float = 120.0,
                  adapt: Callable[[list[RequestSpec]], list[RequestSpec]] = list) -> None:
    """A few short requests so first-call costs (allocation, JIT, oneDNN packing) stay out of the numbers."""
    specs = adapt(random_token_set(4, 64, 8, vocab_ids, seed=12345) + chat_set(2, 8, seed=12345))
    records, _ = await run_load(base_url, model, specs, concurrency=2, timeout_s=timeout_s)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[:2]}")
