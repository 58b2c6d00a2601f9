"""The whole stack through the official `openai` client: router -> prefill -> kv_transfer -> decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.stack import BatonStack, wait_idle

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY = "test-key"


def client(stack: BatonStack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=120)


def chat_text(c: openai.OpenAI, content: str, **kw: object) -> openai.types.chat.ChatCompletion:
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_chat_streamed_equals_non_streamed_with_usage(disagg_stack: BatonStack) -> None:
    c = client(disagg_stack)
    full = chat_text(c, "What is the capital of France?", max_tokens=24, temperature=0)
    assert full.choices[0].message.content
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    parts, usage = [], None
    for chunk in chat_text(c, "What is the capital of France?", max_tokens=24, temperature=0, stream=True,
                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completions_stop_strings_and_max_tokens(disagg_stack: BatonStack) -> None:
    c = client(disagg_stack)
    out = c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0)
    text = out.choices[0].text
    assert out.choices[0].finish_reason in ("length", "stop")
    stopped = c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, stop=[" 8"])
    assert stopped.choices[0].finish_reason == "stop"
    assert " 8" not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)
    one = c.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_logprobs(disagg_stack: BatonStack) -> None:
    c = client(disagg_stack)
    kw = dict(max_tokens=20, temperature=1.0, seed=1234)
    a = chat_text(c, "Tell me a word.", **kw).choices[0].message.content
    b = chat_text(c, "Tell me a word.", **kw).choices[0].message.content
    assert a == b
    # OpenAI's seed is an int64: a negative one crosses the uint64 wire as its two's complement, not a 500
    negative = [chat_text(c, "Tell me a word.", **{**kw, "seed": -1}).choices[0].message.content for _ in range(2)]
    assert negative[0] == negative[1]
    lp = chat_text(c, "Say hi.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_disaggregated_equals_colocated_and_generate(disagg_stack: BatonStack, colocated_stack: BatonStack) -> None:
    prompts = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain."]
    for prompt in prompts:
        d = chat_text(client(disagg_stack), prompt, max_tokens=32, temperature=0).choices[0].message.content
        colo = chat_text(client(colocated_stack), prompt, max_tokens=32, temperature=0).choices[0].message.content
        assert d == colo
    proc = subprocess.run([sys.executable, "-m", "shared.cli.main", "generate", "--chat", "--prompt", prompts[0],
                           "--max-tokens", "32", "--json"], capture_output=True, text=True, timeout=300)
    expected = json.loads(proc.stdout.strip().splitlines()[-1])["text"]
    assert chat_text(client(disagg_stack), prompts[0], max_tokens=32, temperature=0).choices[0].message.content \
        == expected


def test_error_statuses(disagg_stack: BatonStack) -> None:
    url = disagg_stack.base_url
    with pytest.raises(openai.AuthenticationError):
        chat_text(client(disagg_stack, key="wrong"), "hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client(disagg_stack).chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        chat_text(client(disagg_stack), "hi", max_tokens=2, top_p=7.0)
    with pytest.raises(openai.BadRequestError):
        client(disagg_stack).completions.create(model=MODEL, prompt="word " * 3000, max_tokens=2)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{url}/chat/completions", content=b"{not json", headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "hi", "n": 0}, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_no_healthy_backend_is_503(disagg_stack: BatonStack, tmp_path: object) -> None:
    """A router whose only backends are gone answers 503, not a hang."""
    from tests.helpers.redis_server import free_port

    port = free_port()
    env = {"BATON_ROUTER_PORT": str(port), "BATON_ROUTER_STATIC_INSTANCES": f"decode=127.0.0.1:{free_port()},"
           f"prefill=127.0.0.1:{free_port()},kv_transfer=127.0.0.1:{free_port()}"}
    import os
    import time

    proc = subprocess.Popen([sys.executable, "-m", "shared.cli.main", "router"], env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert health.status_code == 503
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string"}}, "required": ["city"]}}}


def test_api_surface_through_the_split_path(disagg_stack: BatonStack) -> None:
    """Content parts, the developer role, tokenize, a batch, tools (auto) and the Responses API, disaggregated."""
    c = client(disagg_stack)
    headers = {"Authorization": f"Bearer {KEY}"}
    root = disagg_stack.base_url.removesuffix("/v1")
    parts: list[Any] = [{"role": "developer", "content": "Answer in one word."},
                        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    plain = chat_text(c, "x", max_tokens=1)  # the model's own defaults: no sampling fields given
    assert plain.choices[0].finish_reason == "length"
    out = c.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    counted = httpx.post(f"{root}/tokenize", json={"messages": parts}, headers=headers, timeout=30).json()["count"]
    assert out.usage is not None and out.usage.prompt_tokens == counted
    conversations = [parts, [{"role": "user", "content": "Name three colors."}]]
    batch = httpx.post(f"{disagg_stack.base_url}/chat/completions/batch", headers=headers, timeout=120, json={
        "model": MODEL, "messages": conversations, "max_tokens": 8, "temperature": 0}).json()
    assert [ch["message"]["content"] for ch in batch["choices"]][0] == out.choices[0].message.content
    tools: Any = [WEATHER_TOOL]
    called = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=tools, max_tokens=60, temperature=0)
    for call in called.choices[0].message.tool_calls or []:
        assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]
    response = c.responses.create(model=MODEL, input="What is the capital of France?", instructions="Be brief.",
                                  max_output_tokens=12, temperature=0)
    streamed = [e for e in c.responses.create(model=MODEL, input="What is the capital of France?",
                                              instructions="Be brief.", max_output_tokens=12, temperature=0,
                                              stream=True)]
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == response.output_text
    follow = c.responses.create(model=MODEL, input="And of Spain?", previous_response_id=response.id,
                                max_output_tokens=4, temperature=0)
    assert follow.usage is not None and response.usage is not None
    assert follow.usage.input_tokens > response.usage.input_tokens


def test_services_refuse_calls_without_the_stacks_token(disagg_stack: BatonStack) -> None:
    """`baton up` gives its services one random internal token: the stack serves (the tests above), and a
    caller on the same host without it is refused by each service and counted."""
    import asyncio

    import grpc.aio

    from proto.baton.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc

    async def stranger() -> list[grpc.StatusCode]:
        codes = []
        async with grpc.aio.insecure_channel(disagg_stack.service("decode-0")["address"]) as ch:
            try:
                await decode_pb2_grpc.DecodeServiceStub(ch).GetLoad(decode_pb2.DecodeLoadRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        async with grpc.aio.insecure_channel(disagg_stack.service("kv_transfer")["address"]) as ch:
            try:  # releasing someone's handoff by guessing its id
                await kv_transfer_pb2_grpc.KVTransferServiceStub(ch).Release(
                    kv_transfer_pb2.ReleaseRequest(handoff_id="guessed"), timeout=10)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        return codes

    assert asyncio.run(stranger()) == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert disagg_stack.metric("decode-0", "baton_grpc_unauthenticated_total") >= 1
    assert disagg_stack.metric("kv_transfer", "baton_grpc_unauthenticated_total") >= 1


def test_engines_lend_each_other_their_cores_while_idle(disagg_stack: BatonStack) -> None:
    """`baton up`'s engines share the host's cores (shared/engine/core_share.py): one request alone is
    prefilled and decoded on every core, not on each engine's share (cores / 3 engines here)."""
    cores = len(os.sched_getaffinity(0))
    wait_idle(disagg_stack)  # no earlier test's request still at work beside this one
    out = client(disagg_stack).completions.create(model=MODEL, prompt="The history of the printing press",
                                                  max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 24
    # the decode's last steps ran while no prefill had work; the prefill that took the prompt had no
    # decode at work beside it (no other request is in flight in this module now)
    assert disagg_stack.metric("decode-0", "baton_engine_torch_threads") == cores
    assert max(disagg_stack.metric(p, "baton_engine_torch_threads") for p in ("prefill-0", "prefill-1")) == cores
    assert disagg_stack.metric("decode-0", "baton_engine_core_share_changes_total") >= (1 if cores > 1 else 0)


def test_services_freeze_their_startup_heap(disagg_stack: BatonStack) -> None:
    """Each engine service and the router, once up, took its start-up objects out of Python's collector
    (shared/service/gc_heap.py); kv_transfer holds no model and does not."""
    services = [s for s in disagg_stack.services() if s["name"].startswith(("router", "prefill", "decode"))]
    assert {s["name"].split("-")[0] for s in services} == {"router", "prefill", "decode"}, services
    for s in services:
        assert "start-up objects frozen out of collections" in Path(s["log"]).read_text(), s["name"]
