"""One request's trace over OTLP: `baton up` as processes, exporting to a collector process.

    otlp_collector (gRPC :port) ◄── OTLP ── router, prefill, kv_transfer, decode (baton up)
Only the standard OTEL_* variables turn tracing on; the children inherit them from
`baton up`. Stopping the stack makes each process flush its spans before it exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.telemetry import REQUEST_ID
from tests.helpers.stack import start_stack

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
MODEL_ARGS = ("--model", "smollm2-135m", "--max-model-len", "512", "--kv-cache-bytes", str(32 << 20),
              "--kv-transfer-capacity-bytes", str(256 << 20))
SERVICES = {"baton-router", "baton-prefill", "baton-kv-transfer", "baton-decode"}


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A collector process: (its OTLP endpoint, the JSON-lines file it writes)."""
    out = tmp_path / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.telemetry.otlp_collector", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("otlp collector listening on "), line
        yield f"http://{line.split()[-1]}", out
    finally:
        proc.terminate()
        proc.wait(10)


def _spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_trace_reaches_a_collector_over_otlp(collector: tuple[str, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint, out = collector
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    for name, value in {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                        "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}.items():
        monkeypatch.setenv(name, value)  # baton up passes its environment on to every child
    stack = start_stack(tmp_path / "stack", *MODEL_ARGS)
    try:
        reply = httpx.post(f"{stack.base_url}/chat/completions", timeout=60, json={
            "model": "smollm2-135m", "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        request_id = reply.headers["x-request-id"]
    finally:
        stack.stop()  # each child flushes its batch processor as it exits
    deadline = time.monotonic() + 10
    while True:
        spans = _spans(out)
        roots = [s for s in spans
                 if s["service"] == "baton-router" and s["attributes"].get(REQUEST_ID) == request_id]
        in_trace = [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"]]
        if {s["service"] for s in in_trace} >= SERVICES or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    logs = {p.name: p.read_text()[-2000:] for p in (tmp_path / "stack" / "logs").glob("*.log")}
    assert len(roots) == 1, (spans, logs)
    assert {s["service"] for s in in_trace} == SERVICES
    assert {s["name"] for s in in_trace} >= {"POST /v1/chat/completions", "prefill.Prefill",
                                             "kv_transfer.Reserve", "kv_transfer.Commit", "kv_transfer.Claim",
                                             "decode.Generate"}
    assert all(s["attributes"][REQUEST_ID] == request_id for s in in_trace
               if s["name"] not in ("kv_transfer.Commit", "kv_transfer.Release"))
    by_id = {s["span_id"]: s for s in in_trace}
    assert all(s["parent_span_id"] in by_id for s in in_trace if s is not roots[0])  # one connected tree
    assert roots[0]["parent_span_id"] == ""
