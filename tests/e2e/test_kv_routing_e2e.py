"""KV-aware routing against real `baton up` stacks (router, prefill, kv_transfer, two decodes, a tiny Gemma 4).

- A burst of 10 greedy streams whose prompts share their first six words once went 9 to one decode and
  1 to the other (load reports lag a burst, and free KV decided first): the router's own in-flight
  counts must spread it evenly.
- With local prefill on, the same prompt goes through prefill + handoff while its decode instance does
  not hold it, and is prefilled on that decode instance once the instance's published prefix summary
  (heartbeats through a real Redis) shows it there: greedy output identical on both paths.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.registry.kv_summary import leading_hits, prompt_block_keys
from shared.registry.redis_registry import RedisRegistry
from tests.helpers.gemma4 import tiny_gemma4_checkpoint
from tests.helpers.stack import BatonStack, start_stack, wait_idle

pytestmark = pytest.mark.slow

ARGS = ("--max-model-len", "256", "--kv-cache-bytes", str(16 << 20), "--prefill", "1", "--decode", "2")
SHARED_WORDS = "Please tell me a long story"  # the first six words of every burst prompt
TOPICS = ["about dragons", "about the sea", "about a robot", "about winter", "about a city", "about music",
          "about two friends", "about a garden", "about the moon", "about a train"]
HEARTBEATS_S = 6.0  # three of the services' heartbeats (a third of the default 6 s TTL each)
LONG_PROMPT = " ".join(f"word{i}" for i in range(80))  # 5+ full blocks of 16: too long to prefill locally


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("kvroute") / "tiny", moe=False)


def assignments(stack: BatonStack) -> dict[tuple[str, str], float]:
    """The router's baton_router_assignments_total samples: (role, instance) -> calls."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    pattern = r'^baton_router_assignments_total\{instance="([^"]*)",role="([^"]*)"\} (\S+)$'
    return {(role, inst): float(v) for inst, role, v in re.findall(pattern, text, re.M)}


def router_metric(stack: BatonStack, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/metrics", timeout=5) as r:
        match = re.search(rf"^{name} (\S+)$", r.read().decode(), re.M)
    assert match, f"{name} not on the router's /metrics"
    return float(match.group(1))


async def complete(client: httpx.AsyncClient, stack: BatonStack, prompt: str, max_tokens: int,
                   stream: bool) -> list[int] | str:
    model = (await client.get(f"{stack.base_url}/models")).json()["data"][0]["id"]
    payload: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True, "stream": stream}
    if not stream:
        r = await client.post(f"{stack.base_url}/completions", json=payload)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])
    num_events = 0
    async with client.stream("POST", f"{stack.base_url}/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            num_events += line.startswith("data: ") and line != "data: [DONE]"
    return [num_events]


def test_a_burst_of_ten_streams_spreads_over_two_decodes(checkpoint: Path, tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--model", str(checkpoint), *ARGS)  # no Redis: the router polls GetLoad
    try:
        async def burst() -> None:
            async with httpx.AsyncClient(timeout=300) as client:
                await asyncio.gather(*(complete(client, stack, f"{SHARED_WORDS} {topic}.", 96, stream=True)
                                       for topic in TOPICS))

        asyncio.run(burst())
        decodes = {inst: n for (role, inst), n in assignments(stack).items() if role == "decode"}
        assert sum(decodes.values()) == 10 and len(decodes) == 2, decodes
        assert min(decodes.values()) >= 4, f"burst split {sorted(decodes.values())}, not balanced"
        wait_idle(stack, ["prefill-0", "decode-0", "decode-1"], timeout_s=15)
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def local_prefill_stack(checkpoint: Path, redis_url: str,
                        tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatonStack]:
    stack = start_stack(tmp_path_factory.mktemp("local"), "--model", str(checkpoint), *ARGS, "--redis-url",
                        redis_url, env={"BATON_ROUTER_LOCAL_PREFILL_MAX_TOKENS": "24"})
    yield stack
    stack.stop()


def test_greedy_output_is_the_same_prefilled_locally_or_handed_off(local_prefill_stack: BatonStack) -> None:
    stack = local_prefill_stack

    async def run() -> tuple[list[str], list[float]]:
        texts: list[str] = []
        locals_after: list[float] = []
        async with httpx.AsyncClient(timeout=300) as client:
            for _ in range(12):  # until the decode's summary (heartbeat, then router refresh) shows the prompt
                texts.append(str(await complete(client, stack, LONG_PROMPT, 16, stream=False)))
                locals_after.append(router_metric(stack, "baton_router_local_prefills_total"))
                if locals_after[-1] > 0:
                    break
                await asyncio.sleep(1.0)
        return texts, locals_after

    texts, locals_after = asyncio.run(run())
    assert locals_after[0] == 0, "the first request should have been handed off (nothing cached yet)"
    assert locals_after[-1] == 1, f"never prefilled locally: {locals_after}"
    assert all(t == texts[0] for t in texts), texts
    roles = {role for role, _ in assignments(stack)}
    assert roles == {"prefill", "decode"}
    time.sleep(0.5)
    wait_idle(stack, ["prefill-0", "decode-0", "decode-1"], timeout_s=15)


def test_instances_publish_the_prefix_blocks_they_hold(local_prefill_stack: BatonStack,
                                                       redis_url: str) -> None:
    """After the long prompt above, the prefill, the decode that served it and kv_transfer's pool list its
    blocks in Redis under the keys the router computes from the prompt's token ids, within a few heartbeats.

    The test above can end a moment after the decode took the prompt's blocks (its second request runs
    locally on the router's own memory of where it sent the prompt), before that decode's next heartbeat
    (a third of the 6 s TTL) carries them: so the listing is read again until every summary shows the
    blocks, or HEARTBEATS_S has passed, which is three beats."""
    stack = local_prefill_stack
    args = list(stack.proc.args)  # type: ignore[arg-type]
    namespace = str(args[args.index("--registry-namespace") + 1])
    token_ids = httpx.post(f"http://127.0.0.1:{stack.port}/tokenize", json={"prompt": LONG_PROMPT},
                           timeout=30).json()["tokens"]

    async def hits() -> dict[str, int]:
        """Each role's best leading hits on the prompt's blocks, from one listing."""
        registry = RedisRegistry.from_url(redis_url, namespace)
        try:
            instances = {s: await registry.list(s) for s in ("prefill", "decode", "kv_transfer")}
        finally:
            await registry.close()
        kv = instances["prefill"][0].kv
        assert kv.block_size == 16
        keys = prompt_block_keys(token_ids, kv.block_size, kv.hash_salt)
        assert len(keys) >= 4
        return {"blocks": len(keys), **{role: max(leading_hits(keys, i.kv.held()) for i in listed)
                                        for role, listed in instances.items()}}

    deadline = time.monotonic() + HEARTBEATS_S
    seen = asyncio.run(hits())
    while min(seen.values()) < seen["blocks"] and time.monotonic() < deadline:
        time.sleep(0.5)
        seen = asyncio.run(hits())
    assert seen == dict.fromkeys(("blocks", "prefill", "decode", "kv_transfer"), seen["blocks"]), seen


def test_a_short_prompt_is_prefilled_on_its_decode_instance(local_prefill_stack: BatonStack) -> None:
    stack = local_prefill_stack

    async def run() -> str:
        async with httpx.AsyncClient(timeout=300) as client:
            return str(await complete(client, stack, "Hello there", 8, stream=False))

    before = router_metric(stack, "baton_router_local_prefills_total")
    prefills_before = sum(n for (role, _), n in assignments(stack).items() if role == "prefill")
    assert asyncio.run(run())
    assert router_metric(stack, "baton_router_local_prefills_total") == before + 1
    assert sum(n for (role, _), n in assignments(stack).items() if role == "prefill") == prefills_before
    wait_idle(stack, ["prefill-0", "decode-0", "decode-1"], timeout_s=15)
