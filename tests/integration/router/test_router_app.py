"""The router over real engines: the official `openai` client against a real uvicorn server, and
httpx over ASGI, on SmolLM2 (the packaged model) and on a tiny random Llama with SmolLM2's tokenizer.

Every test leaves its engine idle with all KV blocks free (checked per test for the tiny engine,
and for both engines when the module ends).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from services.router.app import create_app
from services.router.engine_backend import EngineBackend
from services.router.settings import RouterSettings
from shared.tokenizer import encode_chat, encode_prompt
from tests.integration.router.helpers import SMOL, EngineUnderTest, serve, wait_until

TINY = "tiny-llama"
MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


def app_for(under_test: EngineUnderTest, tokenizer: Any, model_name: str, **settings: Any) -> Any:
    max_model_len = under_test.engine.max_model_len
    return create_app(RouterSettings(max_model_len=max_model_len, **settings), under_test.spy, tokenizer, model_name)


@pytest.fixture
async def tiny_http(tiny: EngineUnderTest, smol_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = app_for(tiny, smol_tokenizer, TINY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        yield http
    tiny.wait_idle()


def sse_events(text: str) -> list[Any]:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


# ---- SmolLM2 through the official client on a real server ---------------------------------------


def test_openai_client_chat_and_completions(smol: EngineUnderTest, smol_tokenizer: Any) -> None:
    with serve(app_for(smol, smol_tokenizer, SMOL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [SMOL]

        full = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=5, temperature=0)
        text = full.choices[0].message.content
        assert full.usage is not None
        assert text and full.choices[0].finish_reason in ("stop", "length")
        assert full.usage.prompt_tokens == len(encode_chat(smol_tokenizer, MESSAGES))
        assert full.usage.completion_tokens == smol.spy.num_tokens[full.id]
        assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

        chunks = list(client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
        last_usage: Any = chunks[-1].usage
        assert chunks[-1].choices == [] and last_usage.completion_tokens == full.usage.completion_tokens
        assert last_usage.prompt_tokens_details.cached_tokens > 0  # same prompt again: prefix cache hit

        prompt = "The capital of France is"
        comp = client.completions.create(model=SMOL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
        choice: Any = comp.choices[0]
        assert comp.usage is not None
        assert comp.usage.prompt_tokens == len(encode_prompt(smol_tokenizer, prompt))
        assert comp.usage.completion_tokens == smol.spy.num_tokens[comp.id] == len(choice.logprobs.tokens)
        assert "".join(choice.logprobs.tokens) == choice.text  # plain ASCII words: tokens spell the text
        streamed = client.completions.create(model=SMOL, prompt=prompt, max_tokens=4, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == choice.text
    smol.wait_idle()


def test_stream_disconnect_aborts_and_frees_blocks(smol: EngineUnderTest, smol_tokenizer: Any) -> None:
    body = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with serve(app_for(smol, smol_tokenizer, SMOL)) as url, httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            request_id = r.headers["x-request-id"]
            lines = r.iter_lines()
            while sum(1 for line in [next(lines)] if line.startswith("data: ")) == 0:
                pass  # leave after the first event: closing the response drops the connection
        wait_until(lambda: request_id in smol.spy.aborted, 10.0)
        smol.wait_idle(10.0)
    assert smol.spy.num_tokens[request_id] < 500


# ---- the tiny engine over ASGI ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_completion_stream_equals_full_with_logprobs(tiny_http: httpx.AsyncClient, tiny: EngineUnderTest) -> None:
    body = {"model": TINY, "prompt": "Hello there", "max_tokens": 24, "temperature": 0, "logprobs": 3,
            "ignore_eos": True}
    full = (await tiny_http.post("/v1/completions", json=body)).json()
    choice = full["choices"][0]
    logprobs = choice["logprobs"]
    assert full["object"] == "text_completion" and full["id"].startswith("cmpl-")
    assert choice["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 24
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 24
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                   strict=True):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob  # the chosen token is listed

    r = await tiny_http.post("/v1/completions", json={**body, "stream": True})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    streamed_tokens = [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed_tokens == logprobs["tokens"]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in events[-1]


@pytest.mark.anyio
async def test_a_stream_interval_streams_the_same_tokens_in_fewer_events(tiny_http: httpx.AsyncClient) -> None:
    """vLLM's per-request stream_interval: the first token alone, then chunks of five, the rest at the end."""
    body = {"model": TINY, "prompt": "Hello there", "max_tokens": 24, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}
    full = (await tiny_http.post("/v1/completions", json=body)).json()["choices"][0]
    events = sse_events((await tiny_http.post("/v1/completions", json={**body, "stream": True,
                                                                       "stream_interval": 5})).text)
    tokens = [e["choices"][0]["logprobs"]["tokens"] for e in events if e["choices"][0]["logprobs"]]
    assert [len(t) for t in tokens] == [1, 5, 5, 5, 5, 3]
    assert [t for chunk in tokens for t in chunk] == full["logprobs"]["tokens"]
    assert "".join(e["choices"][0]["text"] for e in events) == full["text"]


@pytest.mark.anyio
async def test_chat_logprobs_shape(tiny_http: httpx.AsyncClient) -> None:
    body = {"model": TINY, "messages": MESSAGES, "max_completion_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "ignore_eos": True}
    full = (await tiny_http.post("/v1/chat/completions", json=body)).json()
    assert full["object"] == "chat.completion" and full["id"].startswith("chatcmpl-")
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == full["usage"]["completion_tokens"] == 6
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0
        assert all(set(top) == {"token", "logprob", "bytes"} for top in entry["top_logprobs"])
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace") == full["choices"][0]["message"][
        "content"]

    events = sse_events((await tiny_http.post("/v1/chat/completions", json={**body, "stream": True})).text)
    streamed = [e for ev in events for e in (ev["choices"][0]["logprobs"] or {}).get("content", [])]
    # the second run reuses the first's KV from the prefix cache: same tokens, logprobs equal to float noise
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in streamed] == \
        [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    assert "".join(ev["choices"][0]["delta"].get("content", "") for ev in events) == full["choices"][0]["message"][
        "content"]


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings(tiny_http: httpx.AsyncClient, tiny: EngineUnderTest, stream: bool) -> None:
    body = {"model": TINY, "prompt": "Stop here", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = (await tiny_http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # likely spans a token boundary
    expected = text[: text.index(stop)]
    r = await tiny_http.post("/v1/completions", json={**body, "stop": ["never-there", stop], "stream": stream})
    if stream:
        events = sse_events(r.text)
        got, finish_reason = "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        got, finish_reason = choice["text"], choice["finish_reason"]
    assert (got, finish_reason) == (expected, "stop")
    request_id = r.headers["x-request-id"]
    wait_until(lambda: request_id in tiny.spy.aborted, 5.0)  # the engine stopped as soon as it matched
    assert tiny.spy.num_tokens[request_id] < 40


@pytest.mark.anyio
async def test_seeded_sampling_repeats(tiny_http: httpx.AsyncClient) -> None:
    body = {"model": TINY, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50,
            "ignore_eos": True}

    async def sample(seed: int) -> str:
        r = await tiny_http.post("/v1/chat/completions", json={**body, "seed": seed})
        return r.json()["choices"][0]["message"]["content"]

    first = await sample(7)
    assert await sample(7) == first
    assert await sample(8) != first


@pytest.mark.anyio
async def test_models_health_metrics(tiny_http: httpx.AsyncClient) -> None:
    models = (await tiny_http.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [TINY]
    assert models["data"][0]["object"] == "model"
    health = await tiny_http.get("/health")
    # the instance id lets `baton up` tell its own router from another server on the port
    assert health.status_code == 200 and health.json()["instance_id"].startswith("router-")
    await tiny_http.post("/v1/completions", json={"model": TINY, "prompt": "hi", "max_tokens": 3})
    metrics = (await tiny_http.get("/metrics")).text
    assert "baton_time_to_first_token_seconds_count 1.0" in metrics
    assert "baton_inter_token_latency_seconds_count 2.0" in metrics  # 3 tokens, 2 gaps
    assert 'baton_requests_total{status="200"} 1.0' in metrics


@pytest.mark.anyio
async def test_context_length(tiny_http: httpx.AsyncClient, tiny: EngineUnderTest) -> None:
    max_len = tiny.engine.max_model_len
    too_long = {"model": TINY, "prompt": [5] * max_len, "max_tokens": 1}
    error = (await tiny_http.post("/v1/completions", json=too_long)).json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    overflow = {"model": TINY, "prompt": [5] * (max_len - 4), "max_tokens": 5}
    r = await tiny_http.post("/v1/completions", json=overflow)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    fits = {"model": TINY, "prompt": [5] * (max_len - 4), "max_tokens": None, "ignore_eos": True}
    assert (await tiny_http.post("/v1/completions", json=fits)).json()["usage"]["completion_tokens"] == 4


@pytest.mark.anyio
async def test_weird_inputs_never_5xx(tiny_http: httpx.AsyncClient) -> None:
    bodies: list[Any] = [
        {"model": TINY, "prompt": "x", "max_tokens": 2, "temperature": 1e-9, "seed": -1},
        {"model": TINY, "prompt": "x", "max_tokens": 2, "temperature": 1e30, "top_p": 1e-30, "top_k": 10**9},
        {"model": TINY, "prompt": "x", "max_tokens": 2, "stop_token_ids": [-1, 10**12], "min_tokens": 2},
        {"model": TINY, "prompt": [0], "max_tokens": 2, "stop": "\ufffd", "logprobs": 0},
        {"model": TINY, "messages": [{"role": "nobody", "content": None}], "max_tokens": 2},
        {"model": TINY, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "max_tokens": 2},
        {"model": TINY, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"model": TINY, "messages": [{"content": "no role"}]},
        {"model": TINY, "prompt": "x", "max_tokens": 10**12},
        {"model": TINY, "prompt": {"nested": True}},
        {"model": None, "prompt": "x", "max_tokens": 1, "stream": True, "stream_options": None},
    ]
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = await tiny_http.post(path, json=body)
        assert r.status_code < 500, (body, r.text)


@pytest.mark.anyio
async def test_chat_without_template_is_400(tiny: EngineUnderTest, smol_tokenizer: Any) -> None:
    class NoTemplate:
        chat_template = None

        def __getattr__(self, name: str) -> Any:
            return getattr(smol_tokenizer, name)

        def __len__(self) -> int:
            return len(smol_tokenizer)

    app = app_for(tiny, NoTemplate(), TINY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        r = await http.post("/v1/chat/completions", json={"model": TINY, "messages": MESSAGES})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_engine_backend_refusals(tiny: EngineUnderTest, smol_tokenizer: Any) -> None:
    """Not started: 503 (and /health 503); at its request limit: 429."""
    body = {"model": TINY, "prompt": "hi", "max_tokens": 2}
    stopped = EngineBackend(tiny.engine)
    app = create_app(RouterSettings(max_model_len=512), stopped, smol_tokenizer, TINY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        assert (await http.post("/v1/completions", json=body)).status_code == 503
        assert (await http.get("/health")).status_code == 503
    full = EngineBackend(tiny.engine, max_active_requests=0).start()  # refuses before touching the engine
    try:
        app = create_app(RouterSettings(max_model_len=512), full, smol_tokenizer, TINY)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            r = await http.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        full.close()


@pytest.mark.anyio
async def test_engine_step_failure_fails_requests_and_frees_blocks(
    tiny_http: httpx.AsyncClient, tiny: EngineUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = tiny.engine.step
    calls = 0

    def flaky_step() -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("simulated device error")
        return real_step()

    monkeypatch.setattr(tiny.engine, "step", flaky_step)
    body = {"model": TINY, "prompt": "hi", "max_tokens": 20, "ignore_eos": True}
    r = await tiny_http.post("/v1/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    tiny.wait_idle()  # the failed request's blocks went back
    monkeypatch.undo()
    assert (await tiny_http.post("/v1/completions", json=body)).status_code == 200  # and the engine serves on
