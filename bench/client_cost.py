"""What the benchmark client costs the machine it measures: CPU per streamed token, httpx against aiohttp.

    a stand-in SSE server (a subprocess: uvicorn, a chat chunk every --gap-ms, as the router sends them)
    for round in 1..R, for client in (httpx, aiohttp) in alternating order:
        --streams streams one after another, each --tokens chunks
        ─► this process's user + system CPU seconds over the chunks it read
    ─► JSON in bench/results/client_cost-*.json (last stdout line: the summary)

The served benchmarks run their client on the two cores the model computes on, so every millisecond it
spends parsing a chunk is taken from a decode step (bench/serve_overhead.py records it as "client").
The server here does no model work, so the figure is the client's alone; the gap between chunks keeps
the client reading one chunk at a time, as it does against a real decode loop.

    .venv/bin/python -m bench.client_cost [--rounds 3] [--streams 8] [--tokens 128] [--gap-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.results_file import write_results
from bench.serve_load import RequestSpec, client_session, send_one
from bench.serve_machine import machine_info

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.client_cost")
SPEC = RequestSpec("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 128})


def sse_app(gap_s: float):  # type: ignore[no-untyped-def]
    """An ASGI app streaming `max_tokens` chat chunks shaped like the router's, then usage and [DONE]."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        n = int(json.loads(body or b"{}").get("max_tokens", 16))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(n):
            chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "logprobs": None,
                                  "finish_reason": None}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
            await asyncio.sleep(gap_s)
        usage = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode(),
                    "more_body": False})
    return app


async def httpx_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    """The client serve_load.py had before aiohttp: httpx's line iterator, one JSON parse per chunk."""
    chunks = 0
    async with client.stream("POST", SPEC.path, json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            chunks += bool(chunk.get("choices"))
    return chunks


async def time_client(name: str, base_url: str, streams: int, tokens: int) -> dict[str, float]:
    """CPU seconds of this process per chunk over `streams` streams of `tokens` chunks, one at a time."""
    body = {**SPEC.body, "max_tokens": tokens, "model": "m", "stream": True}
    chunks = 0
    if name == "httpx":
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            await httpx_stream(client, body)  # connection and first-call costs stay out
            cpu0, wall0 = sum(os.times()[:2]), time.perf_counter()
            for _ in range(streams):
                chunks += await httpx_stream(client, body)
            cpu, wall = sum(os.times()[:2]) - cpu0, time.perf_counter() - wall0
    else:
        spec = RequestSpec(SPEC.path, {**SPEC.body, "max_tokens": tokens})
        async with client_session(base_url, 1, 60) as session:
            await send_one(session, "m", spec, 60)
            cpu0, wall0 = sum(os.times()[:2]), time.perf_counter()
            for _ in range(streams):
                record = await send_one(session, "m", spec, 60)
                if not record.ok:
                    raise RuntimeError(f"aiohttp stream failed: {record.error}")
                chunks += len(record.token_times_s)
            cpu, wall = sum(os.times()[:2]) - cpu0, time.perf_counter() - wall0
    if chunks != streams * tokens:
        raise RuntimeError(f"{name}: read {chunks} chunks, expected {streams * tokens}")
    return {"cpu_ms_per_token": cpu / chunks * 1e3, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--gap-ms", type=float, default=5.0, help="the server's pause between chunks")
    parser.add_argument("--port", type=int, default=18450)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.serve:
        import uvicorn

        uvicorn.run(sse_app(args.gap_ms / 1e3), host="127.0.0.1", port=args.port, log_level="warning")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    base_url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "bench.client_cost", "--serve", "--port", str(args.port),
                               "--gap-ms", str(args.gap_ms)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(base_url, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the SSE server did not start") from None
                time.sleep(0.2)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = ("httpx", "aiohttp") if r % 2 == 0 else ("aiohttp", "httpx")
            row = {name: asyncio.run(time_client(name, base_url, args.streams, args.tokens)) for name in order}
            logger.info("round %d/%d: CPU ms a token: %s", r + 1, args.rounds,
                        ", ".join(f"{k} {v['cpu_ms_per_token']:.3f}" for k, v in row.items()))
            rounds.append(row)
    finally:
        server.terminate()
        server.wait(timeout=10)
    summary = {name: statistics.median(row[name]["cpu_ms_per_token"] for row in rounds)
               for name in ("httpx", "aiohttp")}
    summary["httpx_over_aiohttp"] = statistics.median(
        row["httpx"]["cpu_ms_per_token"] / row["aiohttp"]["cpu_ms_per_token"] for row in rounds)
    result = {"bench": "client_cost", "rounds_run": rounds, "summary": summary,
              "plan": {"rounds": args.rounds, "streams": args.streams, "tokens": args.tokens, "gap_ms": args.gap_ms},
              "machine": machine_info(Path("/nonexistent"))}
    path = write_results(result, args.out, "client_cost", record_name=True)
    logger.info("wrote %s", path)
    print(json.dumps({"bench": "client_cost", "file": path.name, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
