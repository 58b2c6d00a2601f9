"""Graceful drain: SIGTERM a prefill and a decode with requests in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_load_and_faults import HEADERS, _fresh_stack, body, stream_text

pytestmark = pytest.mark.slow


def test_sigterm_drains_prefill_and_decode(tmp_path: Path, redis_url: str) -> None:
    stack = _fresh_stack(tmp_path, redis_url, "--prefill", "2", "--decode", "2")
    try:
        url = stack.base_url

        async def run() -> list[object]:
            async with httpx.AsyncClient(timeout=90) as client:
                tasks = [asyncio.create_task(stream_text(client, url, body(i, True, 40))) for i in range(8)]
                # the drain is only shown if decode-1 holds requests when the signal comes
                deadline = time.monotonic() + 60
                while (running := stack.metric("decode-1", "baton_num_requests_running")) == 0:
                    assert time.monotonic() < deadline, "no request reached decode-1"
                    await asyncio.sleep(0.05)
                os.kill(stack.service("prefill-1")["pid"], signal.SIGTERM)
                os.kill(stack.service("decode-1")["pid"], signal.SIGTERM)
                held_at_sigterm.append(running)
                t0 = time.monotonic()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                assert time.monotonic() - t0 < 30, "a request hung through the drain"
                # the survivors keep serving once the registry has dropped the drained ones
                after = await asyncio.gather(*(client.post(f"{url}/chat/completions", json=body(i, False, 8),
                                                           headers=HEADERS) for i in range(4)))
                assert [r.status_code for r in after] == [200] * 4
                return results

        held_at_sigterm: list[float] = []
        results = asyncio.run(run())
        assert held_at_sigterm and held_at_sigterm[0] > 0
        completed = [r for r in results if isinstance(r, tuple) and r[1] in ("stop", "length")]
        # a drained decode finishes its running batch: nothing it held is cut off
        assert len(completed) == len(results), [r for r in results if r not in completed]
        for name in ("prefill-1", "decode-1"):
            pid = stack.service(name)["pid"]
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"{name} did not exit after SIGTERM")
        # drained cleanly: `baton up` does not restart them
        assert any("decode-1 exited cleanly (drained); not restarted" in line for line in stack.output)
        for name in ("prefill-0", "decode-0"):
            deadline = time.monotonic() + 10
            while stack.metric(name, "baton_kv_blocks_free") != stack.metric(name, "baton_kv_blocks_total"):
                assert time.monotonic() < deadline, f"{name} leaked KV blocks"
                time.sleep(0.25)
        assert stack.metric("kv_transfer", "baton_handoff_leases_active") == 0
    finally:
        stack.stop()
