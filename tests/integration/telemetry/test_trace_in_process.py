"""One request's trace across router -> prefill -> kv_transfer -> decode, all in this process.

The three gRPC services run in-process on the packaged SmolLM2; the router app runs
over `GrpcBackend` and is driven through httpx's ASGI transport. Spans are collected
by an in-memory exporter on the global tracer provider (see conftest).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from services.router.app import create_app
from services.router.grpc_backend import GrpcBackend
from services.router.instance_cache import InstanceCache
from services.router.settings import RouterSettings
from shared.registry.base import InstanceInfo, Load
from shared.registry.memory_registry import MemoryRegistry
from shared.telemetry import (
    HANDOFF_ID,
    INPUT_TOKENS,
    KV_NBYTES,
    KV_NUM_BLOCKS,
    OUTPUT_TOKENS,
    REQUEST_ID,
)

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
ENGINE: dict[str, Any] = dict(model=MODEL, port=0, metrics_port=-1, kv_cache_bytes=32 << 20,
                              max_model_len=512, kv_claim_wait_s=0.5)
ROUTER_SPAN = "POST /v1/chat/completions"
SERVICE_SPANS = ("prefill.Prefill", "kv_transfer.Reserve", "decode.Generate", "kv_transfer.Claim")
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-00f067aa0ba902b7-01"


async def _serve_requests() -> list[tuple[str, dict[str, Any]]]:
    """Start the stack, send a plain and a streamed chat request; (request id, usage) of each."""
    kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
    prefill = await start_prefill(PrefillSettings(**ENGINE))
    decode = await start_decode(DecodeSettings(**ENGINE))
    registry = MemoryRegistry()
    addresses = {"prefill": prefill.address, "decode": decode.address, "kv_transfer": kv.address}
    for name, address in addresses.items():
        info = InstanceInfo(name, name, address, "", MODEL, Load(0, 0, 100, 100), time.time())
        await registry.register(info, 60)
    cache = InstanceCache(registry)
    await cache.refresh()
    backend = GrpcBackend(cache)
    tokenizer = prefill.host.aengine.engine.loaded.tokenizer
    app = create_app(RouterSettings(max_model_len=512), backend, tokenizer, MODEL)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    served = []
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            plain = await http.post("/v1/chat/completions", json=body)
            assert plain.status_code == 200, plain.text
            served.append((plain.headers["x-request-id"], plain.json()["usage"]))
            streamed = await http.post(
                "/v1/chat/completions", headers={"traceparent": CLIENT_TRACEPARENT},
                json={**body, "stream": True, "stream_options": {"include_usage": True}},
            )
            assert streamed.status_code == 200, streamed.text
            assert "data: [DONE]" in streamed.text
            served.append((streamed.headers["x-request-id"], {}))
        await asyncio.sleep(0.1)
    finally:
        await backend.close()
        for running in (decode, prefill, kv):
            await running.stop()
    return served


def _wait_for_trace(
    exporter: InMemorySpanExporter, request_id: str, timeout_s: float = 5.0
) -> list[ReadableSpan]:
    """The spans of the trace whose router span carries `request_id`, once every service's span ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        finished = exporter.get_finished_spans()
        roots = [s for s in finished if s.name == ROUTER_SPAN and _attrs(s)[REQUEST_ID] == request_id]
        trace_spans = [s for s in finished if roots and s.context.trace_id == roots[0].context.trace_id]
        names = {s.name for s in trace_spans}
        if ({ROUTER_SPAN, *SERVICE_SPANS} <= names) or time.monotonic() > deadline:
            return trace_spans
        time.sleep(0.05)


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_one_trace_spans_router_prefill_kv_transfer_decode(spans: InMemorySpanExporter) -> None:
    served = asyncio.run(_serve_requests())
    trace_ids = set()
    for request_id, usage in served:
        trace_spans = _wait_for_trace(spans, request_id)
        by_name = {s.name: s for s in trace_spans}
        assert {ROUTER_SPAN, *SERVICE_SPANS} <= set(by_name), sorted(by_name)
        router, prefill, put = by_name[ROUTER_SPAN], by_name["prefill.Prefill"], by_name["kv_transfer.Reserve"]
        decode, claim = by_name["decode.Generate"], by_name["kv_transfer.Claim"]
        a = {name: _attrs(span) for name, span in by_name.items()}
        # one trace, one request id, four services (one instrumentation scope each)
        assert {a[name][REQUEST_ID] for name in (ROUTER_SPAN, *SERVICE_SPANS)} == {request_id}
        assert {s.instrumentation_scope.name for s in trace_spans if s.instrumentation_scope} == {
            "services.router.serving", "services.prefill.server", "services.kv_transfer.server",
            "services.decode.server",
        }
        assert {s.kind for s in (router, prefill, put, decode, claim)} == {SpanKind.SERVER}
        # the call tree: router -> prefill -> Reserve, Commit; router -> decode -> Claim, Release
        assert _parent_id(prefill) == router.context.span_id
        assert _parent_id(put) == prefill.context.span_id
        assert _parent_id(by_name["kv_transfer.Commit"]) == prefill.context.span_id
        assert _parent_id(decode) == router.context.span_id
        assert _parent_id(claim) == decode.context.span_id
        put_a, claim_a, prefill_a = _attrs(put), _attrs(claim), _attrs(prefill)
        decode_a, router_a = _attrs(decode), _attrs(router)
        # what moved: the blocks reserved are those claimed and taken by decode; prefill wrote the bytes
        assert put_a[HANDOFF_ID] == claim_a[HANDOFF_ID] == prefill_a[HANDOFF_ID]
        assert prefill_a[KV_NBYTES] > 0
        assert put_a[KV_NUM_BLOCKS] == claim_a[KV_NUM_BLOCKS] == decode_a[KV_NUM_BLOCKS] > 0
        # token counts: prefill sampled the first token, decode the rest
        assert router_a[INPUT_TOKENS] == prefill_a[INPUT_TOKENS] > 0
        assert router_a[OUTPUT_TOKENS] == 6 == decode_a[OUTPUT_TOKENS] + 1
        if usage:
            assert usage["prompt_tokens"] == router_a[INPUT_TOKENS]
            assert usage["completion_tokens"] == router_a[OUTPUT_TOKENS]
        assert router_a["http.response.status_code"] == 200
        trace_ids.add(router.context.trace_id)
    assert len(trace_ids) == 2  # one trace per request
    # the streamed request continued the trace its client sent
    streamed_router = next(s for s in spans.get_finished_spans()
                           if s.name == ROUTER_SPAN and _attrs(s)[REQUEST_ID] == served[1][0])
    assert format(streamed_router.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert _attrs(streamed_router)["baton.stream"] is True
