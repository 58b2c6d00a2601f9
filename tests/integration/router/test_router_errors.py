"""Every error status the router returns, in OpenAI's error JSON, plus disconnects and metrics.

Backends here are scripted (they raise, hang or fail mid-stream on cue); the tokenizer is SmolLM2's.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from services.router.app import create_app
from services.router.backend import BackendChunk
from services.router.settings import RouterSettings
from shared.errors import CapacityError, InvalidRequestError, UnavailableError
from tests.integration.router.helpers import ScriptedBackend, raising, serve, wait_until

pytestmark = pytest.mark.anyio

MODEL = "baton-test"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
DONE_CHUNK = BackendChunk([28], finished=True, finish_reason="length")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def make_app(tokenizer: Any, backend: Any, **settings: Any) -> Any:
    return create_app(RouterSettings(**{"max_model_len": 64, **settings}), backend, tokenizer, MODEL)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert response.headers["x-request-id"]
    return error


BAD_BODIES = [
    ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
    ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
    ("/v1/completions", {**COMPLETION, "top_k": -5}, "top_k"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 9}, "min_tokens"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed"),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": ["x"] * 17}, "stop"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 65}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, -2]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [10**12]}, "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 5}, "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 200}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {str(10**9): 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "min_p": 2}, "min_p"),
    ("/v1/completions", {**COMPLETION, "stream_interval": 0}, "stream_interval"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {
        "name": "not_there"}}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL, TOOL]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "n": 9}, "n"),
    ("/v1/chat/completions", {**CHAT, "thinking_token_budget": 10}, "thinking_token_budget"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 100}, "max_completion_tokens"),  # 100 > context 64
    ("/v1/completions", {**COMPLETION, "prompt": "word " * 80}, "prompt"),  # prompt alone overflows
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
async def test_bad_requests_are_400_with_param(smol_tokenizer: Any, path: str, body: Any, param: str) -> None:
    backend = ScriptedBackend([DONE_CHUNK])
    async with client(make_app(smol_tokenizer, backend)) as http:
        assert_error(await http.post(path, json=body), 400, param)
    assert not backend.requests, "a refused request must not reach the backend"


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b"\xff\xfe", b'"just a string"'])
async def test_malformed_bodies_are_400(smol_tokenizer: Any, content: bytes) -> None:
    async with client(make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]))) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            error = assert_error(await http.post(path, content=content), 400)
            assert error["type"] == "invalid_request_error"


async def test_oversized_body_is_400(smol_tokenizer: Any) -> None:
    app = make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]), max_request_body_bytes=2048)
    async with client(app) as http:
        error = assert_error(await http.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 4096}), 400)
        assert "exceeds" in error["message"]


async def test_max_tokens_limit_refuses_more_and_caps_unset(smol_tokenizer: Any) -> None:
    backend = ScriptedBackend([DONE_CHUNK])
    async with client(make_app(smol_tokenizer, backend, max_tokens_limit=6)) as http:
        assert_error(await http.post("/v1/completions", json={**COMPLETION, "max_tokens": 7}), 400, "max_tokens")
        assert_error(await http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 7}), 400,
                     "max_completion_tokens")
        unset = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}
        assert (await http.post("/v1/completions", json=unset)).status_code == 200
        assert (await http.post("/v1/completions", json={**COMPLETION, "max_tokens": 6})).status_code == 200
    assert [r.params.max_tokens for r in backend.requests] == [6, 6]


async def test_message_count_and_schema_size_limits_are_400(smol_tokenizer: Any) -> None:
    backend = ScriptedBackend([DONE_CHUNK])
    async with client(make_app(smol_tokenizer, backend, max_messages=3, max_schema_bytes=200)) as http:
        many = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 2
        error = assert_error(await http.post("/v1/chat/completions", json={**CHAT, "messages": many}), 400,
                             "messages")
        assert "at most 3 messages" in error["message"]
        big = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20)}}
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}
        error = assert_error(await http.post("/v1/chat/completions",
                                             json={**CHAT, "response_format": response_format}), 400)
        assert "at most 200" in error["message"]
        small = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        assert (await http.post("/v1/chat/completions", json={**CHAT, "response_format": small})).status_code == 200
    assert len(backend.requests) == 1


async def test_openapi_names_every_request_body(smol_tokenizer: Any) -> None:
    """Clients and fuzzers (tests/e2e/test_api_fuzz.py) generate from the document: each POST has its body."""
    async with client(make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]))) as http:
        document = (await http.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    for path, post in ((p, item["post"]) for p, item in document["paths"].items() if "post" in item):
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in schemas, path
    assert {"prompt", "max_tokens", "seed"} <= set(schemas["CompletionRequest"]["properties"])
    assert {"messages", "tools", "response_format"} <= set(schemas["ChatCompletionRequest"]["properties"])


async def test_unknown_fields_are_ignored(smol_tokenizer: Any) -> None:
    async with client(make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]))) as http:
        r = await http.post("/v1/chat/completions", json={**CHAT, "some_future_field": {"x": 1}, "user": "u1"})
        assert r.status_code == 200, r.text


async def test_api_keys(smol_tokenizer: Any) -> None:
    app = make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]), api_keys=["k1", "k2"])
    async with client(app) as http:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k1"}, {"authorization": "Basic k1"}):
            assert_error(await http.post("/v1/chat/completions", json=CHAT, headers=headers), 401)
            assert_error(await http.get("/v1/models", headers=headers), 401)
        ok = await http.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer k2"})
        assert ok.status_code == 200, ok.text
        assert (await http.get("/health")).status_code == 200  # probes and scrapers need no key
        assert (await http.get("/metrics")).status_code == 200


async def test_unknown_model_and_route_are_404(smol_tokenizer: Any) -> None:
    async with client(make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]))) as http:
        assert_error(await http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, "model")
        assert_error(await http.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"}), 404, "model")
        assert_error(await http.get("/v1/models/gpt-9"), 404, "model")
        assert (await http.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        assert_error(await http.get("/v1/nothing-here"), 404)
        assert_error(await http.get("/v1/completions"), 405)


@pytest.mark.parametrize(("error", "status"), [
    (CapacityError("queue full"), 429), (UnavailableError("no decode instance"), 503),
    (InvalidRequestError("prompt holds unknown ids", param="prompt"), 400),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_backend_errors_map_to_status(smol_tokenizer: Any, error: Exception, status: int, stream: bool) -> None:
    backend = raising(error)
    async with client(make_app(smol_tokenizer, backend)) as http:
        r = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert_error(r, status)
        assert r.json()["error"]["message"] == str(error)


@pytest.mark.parametrize("stream", [False, True])
async def test_hidden_internal_errors_keep_their_detail_to_the_log(smol_tokenizer: Any, caplog: Any,
                                                                  stream: bool) -> None:
    caplog.set_level(logging.INFO)
    backend = ScriptedBackend([BackendChunk([28])] if stream else [],
                              error=UnavailableError("decode 10.0.3.7:50052 lost its KV pool"))
    async with client(make_app(smol_tokenizer, backend, hide_internal_errors=True)) as http:
        r = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        refused = await http.post("/v1/chat/completions", json={**CHAT, "temperature": -1})
    if stream:  # failed after its first byte: the error is the stream's last event
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        error = json.loads(events[-2])["error"]
    else:
        error = assert_error(r, 503)
    assert "10.0.3.7" not in r.text and error["code"] == "service_unavailable"
    assert "log has the details" in error["message"]
    assert any("10.0.3.7" in rec.getMessage() for rec in caplog.records)  # the operator still sees it
    assert "temperature" in assert_error(refused, 400, "temperature")["message"]  # 4xx are about the request


async def test_unexpected_backend_exception_is_500_and_logged(smol_tokenizer: Any, caplog: Any) -> None:
    caplog.set_level(logging.ERROR)
    async with client(make_app(smol_tokenizer, raising(RuntimeError("boom")))) as http:
        r = await http.post("/v1/completions", json=COMPLETION)
    error = assert_error(r, 500)
    assert error["type"] == "server_error" and "boom" not in error["message"]
    request_id = r.headers["x-request-id"]
    assert request_id.startswith("cmpl-")
    assert any(request_id in rec.getMessage() for rec in caplog.records), "the log must name the request"


async def test_error_after_stream_started_is_an_sse_event(smol_tokenizer: Any) -> None:
    backend = ScriptedBackend([BackendChunk([28, 29])], error=UnavailableError("decode instance lost"))
    async with client(make_app(smol_tokenizer, backend)) as http:
        r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "service_unavailable"
    assert json.loads(events[1])["choices"][0]["delta"]["content"]  # the tokens before the failure arrived
    assert backend.aborted == [r.headers["x-request-id"]]


async def test_health_follows_backend(smol_tokenizer: Any) -> None:
    backend = ScriptedBackend([DONE_CHUNK])
    async with client(make_app(smol_tokenizer, backend)) as http:
        assert (await http.get("/health")).status_code == 200
        backend.is_healthy = False
        assert_error(await http.get("/health"), 503)


async def test_metrics_count_statuses(smol_tokenizer: Any) -> None:
    async with client(make_app(smol_tokenizer, ScriptedBackend([DONE_CHUNK]))) as http:
        await http.post("/v1/chat/completions", json=CHAT)
        await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        await http.post("/v1/chat/completions", json={**CHAT, "n": 9})  # over max_n
        text = (await http.get("/metrics")).text
    assert 'baton_requests_total{status="200"} 2.0' in text
    assert 'baton_requests_total{status="400"} 1.0' in text
    for name in ("baton_time_to_first_token_seconds", "baton_inter_token_latency_seconds",
                 "baton_e2e_request_latency_seconds"):
        assert f"{name}_count" in text


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_backend_request(smol_tokenizer: Any, stream: bool) -> None:
    """A real server: the client gives up (non-streamed: while waiting; streamed: mid-stream)."""
    backend = ScriptedBackend([BackendChunk([28])], hang=True)
    with serve(make_app(smol_tokenizer, backend)) as url, httpx.Client(base_url=url, timeout=0.5) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
                assert r.status_code == 200
                request_id = r.headers["x-request-id"]
                assert next(r.iter_lines()).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=COMPLETION)
            wait_until(lambda: len(backend.requests) == 1, 5.0)
            request_id = backend.requests[0].request_id
        wait_until(lambda: request_id in backend.aborted, 5.0, lambda: f"aborted: {backend.aborted}")


def scripted_text(tokenizer: Any, text: str, pieces: int = 7) -> ScriptedBackend:
    """A backend that writes `text` (in token chunks) and stops as if on eos."""
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    size = max(1, len(ids) // pieces)
    chunks = [BackendChunk(ids[i:i + size]) for i in range(0, len(ids), size)]
    chunks[-1] = BackendChunk(chunks[-1].token_ids, finished=True, finish_reason="stop")
    return ScriptedBackend(chunks)


async def test_reasoning_and_tool_call_stream_in_openai_shape(smol_tokenizer: Any) -> None:
    """The parsers behind the HTTP layer: reasoning deltas, a call's id/type/name first, then arguments."""
    text = '<think>The user wants weather.</think>\n\nChecking.<tool_call>\n{"name": "get_weather", ' \
           '"arguments": {"city": "Lund"}}\n</tool_call>'
    body = {**CHAT, "max_tokens": 60, "tools": [TOOL]}
    app = make_app(smol_tokenizer, scripted_text(smol_tokenizer, text), reasoning_parser="think", max_model_len=512)
    async with client(app) as http:
        full = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
        events = [json.loads(line[6:]) for line in (await http.post(
            "/v1/chat/completions", json={**body, "stream": True})).text.splitlines()
            if line.startswith("data: {")]
        hidden = (await http.post("/v1/chat/completions", json={**body, "include_reasoning": False})).json()
    assert full["finish_reason"] == "tool_calls"
    message = full["message"]
    assert message["reasoning"] == "The user wants weather." and message["content"] == "Checking."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
            ] == [("function", "get_weather", {"city": "Lund"})]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["id"] and calls[0]["type"] == "function" and calls[0]["function"] == {
        "name": "get_weather", "arguments": ""}
    assert all("id" not in tc and "name" not in tc["function"] for tc in calls[1:])
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Lund"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "reasoning" not in hidden["choices"][0]["message"]
