"""POST /v1/responses through the official client: text and item input, instructions, function calls
and their outputs, streaming events, previous_response_id (in process, and in a real Redis)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from services.router.app import create_app
from services.router.settings import RouterSettings
from tests.helpers.fixtures import redis_url  # noqa: F401  (session fixture)
from tests.integration.router.helpers import EngineUnderTest, serve
from tests.integration.router.test_router_app import TINY
from tests.integration.router.test_router_errors import scripted_text


def client_for(tiny: EngineUnderTest, tokenizer: Any, **settings: Any) -> Iterator[openai.OpenAI]:
    app = create_app(RouterSettings(max_model_len=512, **settings), tiny.spy, tokenizer, TINY)
    with serve(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    tiny.wait_idle()


@pytest.fixture
def client(tiny: EngineUnderTest, smol_tokenizer: Any) -> Iterator[openai.OpenAI]:
    yield from client_for(tiny, smol_tokenizer)


def test_text_input_matches_chat_and_streams(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": TINY, "temperature": 0, "max_output_tokens": 10}
    response = client.responses.create(input="What is the capital of France?", instructions="Be brief.", **kw)
    chat = client.chat.completions.create(model=TINY, temperature=0, max_tokens=10, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}])
    assert response.object == "response" and response.output_text == chat.choices[0].message.content
    assert response.usage is not None and response.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert response.status in ("completed", "incomplete")
    if chat.choices[0].finish_reason == "length":
        assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(input="What is the capital of France?", instructions="Be brief.",
                                          stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    final: Any = events[-1]
    assert final.response.output_text == response.output_text and final.response.usage.output_tokens > 0


def test_items_function_calls_and_previous_response(client: openai.OpenAI) -> None:
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Lund?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Lund"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
    ]
    tools: list[Any] = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    first = client.responses.create(model=TINY, input=items, tools=tools, temperature=0, max_output_tokens=8)
    assert first.output and all(item.type in ("message", "function_call") for item in first.output)
    second = client.responses.create(model=TINY, input="And tomorrow?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=4)
    alone = client.responses.create(model=TINY, input="And tomorrow?", max_output_tokens=1)
    assert second.previous_response_id == first.id
    # the history came along (the tools did not: a request names its own)
    assert second.usage.input_tokens > alone.usage.input_tokens + 20  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=TINY, input="hi", previous_response_id="resp-unknown", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(model=TINY, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=TINY, input="hi", previous_response_id=unstored.id, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=TINY, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}], max_output_tokens=2)


def test_previous_response_in_redis(tiny: EngineUnderTest, smol_tokenizer: Any, redis_url: str) -> None:  # noqa: F811
    """Two routers sharing a Redis: the second continues what the first answered."""
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    a = client_for(tiny, smol_tokenizer, redis_url=redis_url, registry_namespace=namespace)
    client_a = next(a)
    first = client_a.responses.create(model=TINY, input="Hello", temperature=0, max_output_tokens=4)
    alone = client_a.responses.create(model=TINY, input="Again", max_output_tokens=1, store=False)
    next(a, None)
    b = client_for(tiny, smol_tokenizer, redis_url=redis_url, registry_namespace=namespace)
    second = next(b).responses.create(model=TINY, input="Again", previous_response_id=first.id, max_output_tokens=2)
    next(b, None)
    assert second.usage.input_tokens > alone.usage.input_tokens + 4  # type: ignore[union-attr]
    raw = json.loads(redis.Redis.from_url(redis_url).get(f"{namespace}:response:{first.id}"))
    assert raw[0] == {"role": "user", "content": "Hello"} and raw[-1]["role"] == "assistant"


def test_reasoning_and_function_call_items_and_events(smol_tokenizer: Any) -> None:
    """Output items and stream events for reasoning and a call (a scripted backend writes them)."""
    text = '<think>Need the tool.</think>Checking.<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Lund"}}\n</tool_call>'
    tools: list[Any] = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    app = create_app(RouterSettings(max_model_len=512, reasoning_parser="think"),
                     scripted_text(smol_tokenizer, text), smol_tokenizer, TINY)
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        full = client.responses.create(model=TINY, input="Weather in Lund?", tools=tools, max_output_tokens=60)
        events = list(client.responses.create(model=TINY, input="Weather in Lund?", tools=tools,
                                              max_output_tokens=60, stream=True))
    kinds = [item.type for item in full.output]
    assert kinds == ["reasoning", "message", "function_call"]
    reasoning: Any = full.output[0]
    call: Any = full.output[2]
    assert reasoning.content[0].text == "Need the tool." and full.output_text == "Checking."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lund"} and call.call_id
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == kinds  # type: ignore[attr-defined]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Lund"}
    done: Any = events[-1]
    assert done.type == "response.completed" and [i.type for i in done.response.output] == kinds
