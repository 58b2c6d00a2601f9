"""API keys on a real uvicorn router: a keys file rotated while serving, per-key concurrency (a stream holds
its slot until it ends) and rate limits answered with 429 and Retry-After."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.router.backend import BackendChunk
from tests.integration.router.helpers import ScriptedBackend, serve
from tests.integration.router.test_router_errors import CHAT, DONE_CHUNK, assert_error, make_app

pytestmark = pytest.mark.anyio


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_a_rotated_keys_file_takes_effect_without_a_restart(smol_tokenizer: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("old-key\n")
    app = make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]), api_keys_file=keys)
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert (await http.post("/v1/chat/completions", json=CHAT, headers=bearer("old-key"))).status_code == 200
            assert_error(await http.post("/v1/chat/completions", json=CHAT, headers=bearer("new-key")), 401)
            keys.write_text("new-key\n")
            os.utime(keys, ns=(keys.stat().st_atime_ns, keys.stat().st_mtime_ns + 10**9))
            deadline = time.monotonic() + 5
            while (await http.get("/v1/models", headers=bearer("new-key"))).status_code != 200:
                assert time.monotonic() < deadline, "the new key never took effect"
                await asyncio.sleep(0.2)
            assert (await http.post("/v1/chat/completions", json=CHAT, headers=bearer("new-key"))).status_code == 200
            assert_error(await http.post("/v1/chat/completions", json=CHAT, headers=bearer("old-key")), 401)


async def test_a_stream_holds_its_keys_slot_until_it_ends(smol_tokenizer: Any) -> None:
    backend = ScriptedBackend([BackendChunk([28])], hang=True)  # streams until the client leaves
    app = make_app(smol_tokenizer, backend, api_keys=["k1", "k2"], max_concurrent_per_key=1)
    stream_body = {**CHAT, "stream": True, "max_tokens": 20}
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            async with http.stream("POST", "/v1/chat/completions", json=stream_body, headers=bearer("k1")) as first:
                assert first.status_code == 200
                async for line in first.aiter_lines():
                    if line.startswith("data: "):
                        break  # streaming: k1's one slot is taken
                refused = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("k1"))
                error = assert_error(refused, 429)
                assert error["type"] == "rate_limit_error" and "1 in flight" in error["message"]
                assert int(refused.headers["retry-after"]) >= 1
                assert (await http.get("/v1/models", headers=bearer("k2"))).status_code == 200  # per key
            # the client left: the router aborts the stream and the slot comes back
            deadline = time.monotonic() + 10
            backend.chunks, backend.hang = [DONE_CHUNK], False  # what the next requests play
            while True:
                again = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("k1"))
                if again.status_code == 200:
                    break
                assert again.status_code == 429 and time.monotonic() < deadline, again.text
                await asyncio.sleep(0.1)


async def test_requests_per_minute_per_key(smol_tokenizer: Any) -> None:
    app = make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]), api_keys=["k1"], requests_per_minute_per_key=2)
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            statuses = [(await http.post("/v1/chat/completions", json=CHAT, headers=bearer("k1"))) for _ in range(3)]
            assert [r.status_code for r in statuses] == [200, 200, 429]
            assert 25 <= int(statuses[2].headers["retry-after"]) <= 30  # one request every 30 s
            assert "2 a minute" in statuses[2].json()["error"]["message"]
            assert (await http.get("/health")).status_code == 200  # probes are never limited
