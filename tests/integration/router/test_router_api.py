"""The API surface past plain text, against real engines: tokenize, content parts, defaults from the
model's generation config, stop-token handling, token ids, echo, several prompts, tools and reasoning
through the chat template. The tiny engine shares SmolLM2's tokenizer; every test leaves it idle."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.router.app import create_app
from services.router.settings import RouterSettings
from shared.models.generation_config import GenerationDefaults, load_generation_defaults
from tests.integration.router.helpers import SMOL, EngineUnderTest, serve
from tests.integration.router.test_router_app import TINY, sse_events

pytestmark = pytest.mark.anyio
MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"model": TINY, "temperature": 0, "ignore_eos": True}


def client_for(under_test: EngineUnderTest, tokenizer: Any, defaults: GenerationDefaults | None = None,
               **settings: Any) -> httpx.AsyncClient:
    app = create_app(RouterSettings(max_model_len=under_test.engine.max_model_len, **settings), under_test.spy,
                     tokenizer, TINY, defaults)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


@pytest.fixture
async def http(tiny: EngineUnderTest, smol_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(tiny, smol_tokenizer) as client:
        yield client
    tiny.wait_idle()


async def chat(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await http.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def test_tokenize_detokenize(http: httpx.AsyncClient, smol_tokenizer: Any) -> None:
    r = (await http.post("/tokenize", json={"model": TINY, "prompt": "Hello world", "return_token_strs": True})).json()
    assert r["tokens"] == smol_tokenizer("Hello world").input_ids and r["count"] == len(r["tokens"])
    assert r["token_strs"] == smol_tokenizer.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] == 512
    assert (await http.post("/detokenize", json={"tokens": r["tokens"]})).json() == {"prompt": "Hello world"}
    counted = (await http.post("/tokenize", json={"messages": MESSAGES})).json()["count"]
    assert counted == (await chat(http, max_tokens=1))["usage"]["prompt_tokens"]
    bad = await http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = await http.post("/tokenize", json={"prompt": "x", "messages": MESSAGES})
    assert both.status_code == 400


async def test_content_parts_developer_role_and_name(http: httpx.AsyncClient) -> None:
    plain = [{"role": "system", "content": "Be brief.\nVery."}, {"role": "user", "content": "Hi", "name": "ann"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Very."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"}]
    a = (await http.post("/tokenize", json={"messages": plain})).json()["tokens"]
    b = (await http.post("/tokenize", json={"messages": parts})).json()["tokens"]
    assert a == b
    assert (await chat(http, messages=parts, max_tokens=3))["choices"][0]["message"]["content"]


async def test_generation_config_defaults_and_request_wins(tiny: EngineUnderTest, smol_tokenizer: Any,
                                                           tmp_path: Path) -> None:
    body = {"model": TINY, "messages": MESSAGES, "max_tokens": 12, "ignore_eos": True}
    async with client_for(tiny, smol_tokenizer) as plain:
        greedy = (await plain.post("/v1/chat/completions", json={**body, "temperature": 0})).json()
    async with client_for(tiny, smol_tokenizer, GenerationDefaults(temperature=0.0, top_k=5)) as defaulted:
        runs = [(await defaulted.post("/v1/chat/completions", json=body)).json() for _ in range(2)]
        own = [(await defaulted.post("/v1/chat/completions", json={**body, "temperature": 1.5, "top_k": 0,
                                                                     "seed": s})).json() for s in range(3)]
    text = greedy["choices"][0]["message"]["content"]
    assert [r["choices"][0]["message"]["content"] for r in runs] == [text, text]  # the default temperature 0
    assert any(r["choices"][0]["message"]["content"] != text for r in own)  # the request's own values win
    tiny.wait_idle()
    assert load_generation_defaults("auto", "smollm2-135m", tmp_path).as_dict() == {"temperature": 0.2, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "eos_token_id": 2}))
    assert load_generation_defaults("auto", "smollm2-135m", tmp_path).as_dict() == {"temperature": 0.6, "top_k": 20}
    assert load_generation_defaults("vllm", "smollm2-135m", tmp_path).as_dict() == {}


async def test_stop_tokens_token_ids_and_include_stop_str(http: httpx.AsyncClient, smol_tokenizer: Any) -> None:
    base = {**GREEDY, "prompt": "Hello there", "max_tokens": 16, "return_token_ids": True}
    full = (await http.post("/v1/completions", json=base)).json()["choices"][0]
    assert full["prompt_token_ids"] == smol_tokenizer("Hello there").input_ids and len(full["token_ids"]) == 16
    stop_id = full["token_ids"][5]
    first = full["token_ids"].index(stop_id)
    stopped = (await http.post("/v1/completions", json={**base, "stop_token_ids": [stop_id]})).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == full["token_ids"][:first + 1]
    assert stopped["text"] == smol_tokenizer.decode(full["token_ids"][:first])  # the stop token is not text
    kept = (await http.post("/v1/completions", json={**base, "stop_token_ids": [stop_id],
                                                     "include_stop_str_in_output": True})).json()["choices"][0]
    assert kept["text"] == smol_tokenizer.decode(full["token_ids"][:first + 1])
    stop = full["text"][4:7]
    with_str = (await http.post("/v1/completions", json={**base, "stop": [stop], "include_stop_str_in_output": True}
                                )).json()["choices"][0]
    assert with_str["text"] == full["text"][:full["text"].index(stop) + len(stop)]


async def test_several_prompts_echo_and_streams(http: httpx.AsyncClient, smol_tokenizer: Any) -> None:
    prompts = ["Hello there", "The sky is"]
    singles = [(await http.post("/v1/completions", json={**GREEDY, "prompt": p, "max_tokens": 8})).json()
               for p in prompts]
    ids = [smol_tokenizer(p).input_ids for p in prompts]
    for prompt in (prompts, ids):
        both = (await http.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 8})).json()
        assert [c["index"] for c in both["choices"]] == [0, 1]
        assert [c["text"] for c in both["choices"]] == [s["choices"][0]["text"] for s in singles]
        assert both["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
        assert both["usage"]["completion_tokens"] == 16
    echoed = (await http.post("/v1/completions", json={**GREEDY, "prompt": prompts, "max_tokens": 8, "echo": True}
                              )).json()
    assert [c["text"] for c in echoed["choices"]] == [p + s["choices"][0]["text"] for p, s in zip(prompts, singles, strict=True)]
    r = await http.post("/v1/completions", json={**GREEDY, "prompt": prompts, "max_tokens": 8, "echo": True,
                                                 "stream": True})
    events = sse_events(r.text)
    for index, (prompt, single) in enumerate(zip(prompts, singles, strict=True)):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == prompt + single["choices"][0]["text"]
        assert mine[-1]["finish_reason"] == "length"


def test_tools_auto_and_history_with_smollm2(smol: EngineUnderTest, smol_tokenizer: Any) -> None:
    """SmolLM2's template has no tools: the default prompt shows them; whatever the model writes parses."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    app = create_app(RouterSettings(max_model_len=1024), smol.spy, smol_tokenizer, SMOL)
    with serve(app) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
        full = c.chat.completions.create(model=SMOL, messages=messages, tools=tools, temperature=0,  # type: ignore[arg-type]
                                         max_tokens=60)
        message = full.choices[0].message
        for call in message.tool_calls or []:
            assert call.function.name and isinstance(json.loads(call.function.arguments), dict)
        assert (full.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)
        parts, calls = [], {}
        for chunk in c.chat.completions.create(model=SMOL, messages=messages, tools=tools, temperature=0,  # type: ignore[arg-type]
                                               max_tokens=60, stream=True):
            delta = chunk.choices[0].delta
            parts.append(delta.content or "")
            for tc in delta.tool_calls or []:
                calls.setdefault(tc.index, []).append(tc)
        assert "".join(parts) == (message.content or "")
        assert [json.loads("".join(tc.function.arguments or "" for tc in calls[i])) for i in sorted(calls)] == \
            [json.loads(tc.function.arguments) for tc in message.tool_calls or []]
        history: list[Any] = [*messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
        after = c.chat.completions.create(model=SMOL, messages=history, tools=tools, temperature=0, max_tokens=30)  # type: ignore[arg-type]
        assert after.choices[0].message.content or after.choices[0].message.tool_calls
    smol.wait_idle()


async def test_chat_batch_one_choice_per_conversation(http: httpx.AsyncClient) -> None:
    conversations = [MESSAGES, [{"role": "user", "content": "Name a color."}]]
    singles = [(await chat(http, messages=c, max_tokens=8))["choices"][0]["message"]["content"] for c in conversations]
    body = {**GREEDY, "messages": conversations, "max_tokens": 8}
    batch = (await http.post("/v1/chat/completions/batch", json=body)).json()
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [(c["index"], c["message"]["content"]) for c in batch["choices"]] == list(enumerate(singles))
    events = sse_events((await http.post("/v1/chat/completions/batch", json={**body, "stream": True})).text)
    for index, single in enumerate(singles):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content", "") for c in mine) == single
    bad = await http.post("/v1/chat/completions/batch", json={**body, "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


async def test_logit_bias_penalties_and_min_p_reach_the_engine(http: httpx.AsyncClient) -> None:
    body = {**GREEDY, "prompt": "Hello there", "max_tokens": 6, "return_token_ids": True}
    plain = (await http.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
    forced = next(t for t in range(100, 200) if t not in plain)
    biased = (await http.post("/v1/completions", json={**body, "logit_bias": {str(forced): 100}})).json()
    assert biased["choices"][0]["token_ids"] == [forced] * 6
    banned = (await http.post("/v1/completions", json={**body, "logit_bias": {str(plain[0]): -100}})).json()
    assert banned["choices"][0]["token_ids"][0] != plain[0]
    repeated = (await http.post("/v1/completions", json={**body, "max_tokens": 24, "frequency_penalty": 2.0,
                                                         "presence_penalty": 2.0, "repetition_penalty": 1.3,
                                                         "min_p": 0.1})).json()["choices"][0]["token_ids"]
    assert len(repeated) == 24


async def test_n_choices_each_with_its_seed_and_index(http: httpx.AsyncClient) -> None:
    body = {"model": TINY, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 5,
            "return_token_ids": True, "ignore_eos": True}
    several = (await http.post("/v1/completions", json={**body, "n": 3})).json()["choices"]
    assert [c["index"] for c in several] == [0, 1, 2]
    for i, choice in enumerate(several):  # choice i samples as an n = 1 request seeded seed + i
        alone = (await http.post("/v1/completions", json={**body, "seed": 5 + i})).json()["choices"][0]
        assert choice["token_ids"] == alone["token_ids"] and choice["text"] == alone["text"]
    streamed = await http.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES, "max_tokens": 4, "n": 2,
                                                              "stream": True})
    events = sse_events(streamed.text)
    finished = sorted(c["index"] for e in events for c in e["choices"] if c.get("finish_reason"))
    assert finished == [0, 1]


async def test_prompt_logprobs_score_every_prompt_token(http: httpx.AsyncClient, smol_tokenizer: Any) -> None:
    r = await http.post("/v1/completions", json={**GREEDY, "prompt": "The capital of France is", "max_tokens": 1,
                                                  "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    prompt = smol_tokenizer("The capital of France is").input_ids
    assert entries[0] is None and len(entries) == len(prompt)
    for token_id, entry in zip(prompt[1:], entries[1:], strict=True):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] <= 0.0


async def test_echo_with_logprobs_scores_the_echoed_prompt(http: httpx.AsyncClient, smol_tokenizer: Any) -> None:
    prompt = "The capital of France is"
    r = await http.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 3, "echo": True,
                                                  "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    logprobs, num_prompt = choice["logprobs"], len(smol_tokenizer(prompt).input_ids)
    assert choice["text"].startswith(prompt) and "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert len(logprobs["tokens"]) == num_prompt + 3
    assert logprobs["text_offset"][num_prompt] == len(prompt) and "prompt_logprobs" not in choice
