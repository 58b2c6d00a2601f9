"""Grammar-constrained outputs through the router with SmolLM2: forced tool calls whose arguments
validate against the tool's parameters, response_format and structured_outputs, a batch."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai

from services.router.app import create_app
from services.router.settings import RouterSettings
from tests.integration.router.helpers import SMOL, EngineUnderTest, serve

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "parameters": {
                  "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]}}}]
ASK: Any = [{"role": "user", "content": "What is the weather in Lund?"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "population_millions": {"type": "integer", "minimum": 0, "maximum": 50}},
          "required": ["name", "population_millions"], "additionalProperties": False}


def test_forced_tools_and_structured_outputs(smol: EngineUnderTest, smol_tokenizer: Any) -> None:
    app = create_app(RouterSettings(max_model_len=1024), smol.spy, smol_tokenizer, SMOL)
    with serve(app) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        kw: dict[str, Any] = {"model": SMOL, "messages": ASK, "tools": TOOLS, "max_tokens": 80}
        named = c.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          temperature=0, **kw)
        calls = named.choices[0].message.tool_calls or []
        assert [call.function.name for call in calls] == ["get_weather"]  # type: ignore[union-attr]
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)  # type: ignore[union-attr]
        streamed = list(c.chat.completions.create(tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, temperature=0, stream=True, **kw))
        fragments = [tc for ch in streamed if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert fragments[0].function.name == "get_weather" and fragments[0].id  # type: ignore[union-attr]
        assert json.loads("".join(f.function.arguments or "" for f in fragments)) == json.loads(
            calls[0].function.arguments)  # type: ignore[union-attr]
        for seed in range(3):  # sampled: any of the tools, always valid, one call (parallel_tool_calls false)
            required = c.chat.completions.create(tool_choice="required", parallel_tool_calls=False,
                                                 temperature=1.0, seed=seed, **kw)
            choice = required.choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls or []) == 1
            call = (choice.message.tool_calls or [])[0]
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), schema)  # type: ignore[union-attr]
        answer = c.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Describe Paris."}],
                                           max_tokens=80, temperature=0, response_format={
                                               "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                                                      "strict": True}})
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
        picked = c.chat.completions.create(model=SMOL, messages=ASK, max_tokens=10, extra_body={
            "structured_outputs": {"choice": ["sunny", "rainy"]}})
        assert picked.choices[0].message.content in ("sunny", "rainy")
        dated = c.completions.create(model=SMOL, prompt="Today is", max_tokens=20, extra_body={
            "structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", dated.choices[0].text)
    smol.wait_idle()
