"""The benchmark's streaming client against a real HTTP server (uvicorn, bench/client_cost.py's SSE app)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from bench.client_cost import sse_app
from bench.serve_load import RequestSpec, client_session, run_load, send_one
from tests.helpers.redis_server import free_port

SPEC = RequestSpec("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})


@pytest.fixture(scope="module")
def sse_server() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(sse_app(0.002), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_send_one_times_each_chunk_and_reads_usage(sse_server: str) -> None:
    async def go():  # type: ignore[no-untyped-def]
        async with client_session(sse_server, 1, 30) as session:
            return await send_one(session, "m", SPEC, 30)
    record = asyncio.run(go())
    assert record.ok, record.error
    assert record.text == " tok0 tok1 tok2 tok3 tok4"
    assert len(record.token_times_s) == 5 and record.token_times_s == sorted(record.token_times_s)
    assert record.token_times_s[0] > record.sent_s
    assert record.output_tokens == 5 and record.prompt_tokens == 1


def test_run_load_keeps_send_order_and_reports_a_dead_server_as_errors(sse_server: str) -> None:
    specs = [RequestSpec(SPEC.path, {**SPEC.body, "max_tokens": n}) for n in (3, 1, 2)]
    records, wall_s = asyncio.run(run_load(sse_server, "m", specs, concurrency=2, timeout_s=30))
    assert [r.output_tokens for r in records] == [3, 1, 2] and wall_s > 0
    dead, _ = asyncio.run(run_load(f"http://127.0.0.1:{free_port()}", "m", specs[:1], timeout_s=10))
    assert not dead[0].ok and "ClientConnectorError" in (dead[0].error or "")
