"""Concurrency, cancellation and dead instances against real `baton up` stacks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL_ARGS
from tests.helpers.stack import BatonStack, start_stack, wait_idle

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
HEADERS = {"Authorization": "Bearer test-key"}


def body(i: int, stream: bool, max_tokens: int = 24, ignore_eos: bool = False) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream, "ignore_eos": ignore_eos}


async def stream_text(client: httpx.AsyncClient, url: str, payload: dict[str, object],
                      stop_after: int | None = None) -> tuple[str, str | None]:
    """Concatenated deltas and the finish reason; with stop_after, close the connection early."""
    parts: list[str] = []
    finish = None
    async with client.stream("POST", f"{url}/chat/completions", json=payload, headers=HEADERS) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                parts.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
            if stop_after is not None and len(parts) >= stop_after:
                return "".join(parts), None  # leaving the block closes the connection
    return "".join(parts), finish


def test_32_concurrent_streams_16_cancelled(disagg_stack: BatonStack) -> None:
    url = disagg_stack.base_url

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            expected = await asyncio.gather(*(client.post(f"{url}/chat/completions", json=body(i, False),
                                                          headers=HEADERS) for i in range(16)))
            texts = [r.json()["choices"][0]["message"]["content"] for r in expected]
            long = [stream_text(client, url, body(i, True, max_tokens=400), stop_after=3) for i in range(16)]
            full = [stream_text(client, url, body(i, True)) for i in range(16)]
            results = await asyncio.gather(*full, *long)
        for i, (text, finish) in enumerate(results[:16]):
            assert text == texts[i], f"stream {i} lost or duplicated tokens"
            assert finish in ("stop", "length")

    asyncio.run(run())
    wait_idle(disagg_stack, ["prefill-0", "prefill-1", "decode-0"], timeout_s=10)


def _fresh_stack(tmp_path: Path, redis_url: str, *args: str) -> BatonStack:
    return start_stack(tmp_path, *MODEL_ARGS, "--redis-url", redis_url, "--api-key", "test-key", *args)


LONG_PROMPT = " ".join(f"item{i}" for i in range(240))  # ~860 tokens: the prefill is still computing when killed


def _completion(i: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": f"{i}: {LONG_PROMPT}", "max_tokens": 8, "temperature": 0}


def _kill_first_busy(stack: BatonStack, names: list[str], metric: str, timeout_s: float,
                     stop: bool = False) -> str:
    """SIGKILL (or with `stop`, SIGSTOP) the first of `names` seen with `metric` above 0 (work under way
    there); its name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in names:
            if stack.metric(name, metric) > 0:
                if stop:
                    os.kill(stack.service(name)["pid"], signal.SIGSTOP)
                else:
                    stack.kill(name)
                return name
    raise AssertionError(f"none of {names} was seen busy ({metric})")


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_prefill_killed_or_stopped_mid_prompt_is_retried_on_the_other(tmp_path: Path, redis_url: str,
                                                                         fault: str) -> None:
    """Requests prefilling on the killed instance are retried on the other before any token was sent: every
    one succeeds, with the tokens a run without the fault gives (greedy). A stopped (SIGSTOP) instance closes
    no socket: the router's channel finds it dead when its pings go unanswered (grpc_common.py), within
    about the stall timeout, and once woken it frees what the abandoned requests held."""
    stack = _fresh_stack(tmp_path, redis_url, "--prefill", "2", "--decode", "1", "--decode-stall-timeout", "3")
    victim = None
    try:
        url = stack.base_url

        async def run() -> list[str]:
            nonlocal victim
            async with httpx.AsyncClient(timeout=120) as client:
                inflight = [asyncio.create_task(client.post(f"{url}/completions", json=_completion(i),
                                                            headers=HEADERS)) for i in range(8)]
                victim = await asyncio.to_thread(_kill_first_busy, stack, ["prefill-0", "prefill-1"],
                                                 "baton_num_requests_running", 60, fault == "stop")
                done = await asyncio.gather(*inflight)
                assert [r.status_code for r in done] == [200] * 8, [r.text for r in done if r.status_code != 200]
                return [r.json()["choices"][0]["text"] for r in done]

        faulted = asyncio.run(run())
        if fault == "stop":
            assert victim is not None
            os.kill(stack.service(victim)["pid"], signal.SIGCONT)
            wait_idle(stack, ["prefill-0", "prefill-1", "decode-0"], 30)

        async def again() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as client:
                done = await asyncio.gather(*(client.post(f"{url}/completions", json=_completion(i), headers=HEADERS)
                                              for i in range(8)))
                return [r.json()["choices"][0]["text"] for r in done]

        assert asyncio.run(again()) == faulted
        router_log = (tmp_path / "logs" / "router.log").read_text().splitlines()
        retried = [line for line in router_log if "retrying elsewhere" in line]
        assert retried and all(stack.service(victim)["address"] in line for line in retried), retried
        assert not any("Too many pings" in line for line in router_log)  # the live one took the pings
    finally:
        if fault == "stop" and victim is not None:
            os.kill(stack.service(victim)["pid"], signal.SIGCONT)
        stack.stop()


def test_a_killed_kv_transfer_fails_its_handoffs_cleanly_and_comes_back(tmp_path: Path, redis_url: str) -> None:
    """SIGKILL the only kv_transfer with handoffs in flight: each request is served (its prompt computed on
    the decode instance, or handed off through the restarted kv_transfer) or ends with a 5xx in OpenAI's
    shape within 30 s (never a hang); `baton up` restarts it and the stack serves again."""
    stack = _fresh_stack(tmp_path, redis_url, "--prefill", "1", "--decode", "1")
    try:
        url = stack.base_url

        async def run() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                async def timed(i: int) -> tuple[httpx.Response, float]:
                    r = await client.post(f"{url}/completions", json=_completion(i), headers=HEADERS)
                    return r, time.monotonic()

                inflight = [asyncio.create_task(timed(i)) for i in range(4)]
                await asyncio.to_thread(_kill_first_busy, stack, ["kv_transfer"], "baton_handoff_leases_active", 60)
                killed_at = time.monotonic()
                for r, ended_at in await asyncio.gather(*inflight):
                    if r.status_code != 200:
                        assert r.status_code >= 500 and r.json()["error"]["message"], r.text
                        assert ended_at - killed_at < 30, r.text
                deadline = time.monotonic() + 180
                while True:  # restarted, registered, its slab cut again: served
                    r = await client.post(f"{url}/completions", json=_completion(0), headers=HEADERS)
                    if r.status_code == 200:
                        break
                    assert r.status_code >= 500 and time.monotonic() < deadline, r.text
                    await asyncio.sleep(1.0)

        asyncio.run(run())
        assert any("restarted kv_transfer" in line for line in stack.output)
    finally:
        stack.stop()


def test_killing_the_only_decode_gives_errors_not_hangs_then_the_supervisor_restarts_it(
        tmp_path: Path, redis_url: str) -> None:
    # the restart waits 15 s: the streams' errors come after the router's migration wait for another decode
    # (3 s here, 15 by default), and the stack must still be seen without a decode after them
    stack = start_stack(tmp_path, *MODEL_ARGS, "--redis-url", redis_url, "--api-key", "test-key", "--prefill", "1",
                        "--decode", "1", "--restart-backoff", "15", env={"BATON_ROUTER_MIGRATION_WAIT_S": "3"})
    try:
        url = stack.base_url

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                # long and unable to end early: every stream is still running when decode dies
                streams = [asyncio.create_task(stream_text(client, url, body(i, True, 900, ignore_eos=True)))
                           for i in range(3)]
                await asyncio.sleep(1.0)
                old_pid = stack.service("decode-0")["pid"]
                stack.kill("decode-0")
                t0 = time.monotonic()
                results = await asyncio.gather(*streams, return_exceptions=True)
                assert time.monotonic() - t0 < 30
                assert all(isinstance(r, (AssertionError, httpx.HTTPError)) for r in results), results
                r = await client.post(f"{url}/chat/completions", json=body(0, False, 4), headers=HEADERS)
                assert r.status_code == 503 and r.json()["error"]["message"]
                deadline = time.monotonic() + 180
                while True:  # restarted (a new process), loaded, registered: served again
                    r = await client.post(f"{url}/chat/completions", json=body(0, False, 4), headers=HEADERS)
                    if r.status_code == 200:
                        break
                    assert time.monotonic() < deadline, r.text
                    await asyncio.sleep(1.0)
                assert stack.service("decode-0")["pid"] != old_pid
                assert any("restarted decode-0 (restart 1 of 3)" in line for line in stack.output)

        asyncio.run(run())
    finally:
        stack.stop()


def test_a_taken_router_port_stops_baton_up_before_it_starts_anything(tmp_path: Path) -> None:
    """Another server on the port once answered the health check for the router that could not bind it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "shared.cli.main", "up", *MODEL_ARGS, "--port", str(port),
                               "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {port} on 127.0.0.1, which router needs, is in use" in done.stderr
    assert "started" not in done.stdout and not (tmp_path / "logs").exists()


def test_full_kv_store_is_429_and_small_requests_still_pass(tmp_path: Path, redis_url: str) -> None:
    """A handoff that cannot fit kv_transfer's store is backpressure (429), not a crash or an OOM."""
    # 3 MiB: four slots of one SmolLM2 block (every layer, 720 KiB)
    stack = _fresh_stack(tmp_path, redis_url, "--kv-transfer-capacity-bytes", str(3 << 20))
    try:
        url = stack.base_url
        big = {"model": MODEL, "prompt": "word " * 60, "max_tokens": 4}  # 4 blocks of KV + hidden states
        r = httpx.post(f"{url}/completions", json=big, headers=HEADERS, timeout=60)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        small = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}  # one block + hidden states: fits
        assert httpx.post(f"{url}/completions", json=small, headers=HEADERS, timeout=60).status_code == 200
    finally:
        stack.stop()
