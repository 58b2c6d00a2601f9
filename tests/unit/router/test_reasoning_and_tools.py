"""Reasoning parsers, the tool plan (grammars for required/named choices) and the default tool prompt."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.router.chat_output import ChoiceOutput, MessageDelta
from services.router.protocol import ToolDefinition
from services.router.reasoning_parsers import ReasoningParser, get_format
from services.router.tool_parsers.base import get_parser
from services.router.tool_prompt import template_supports_tools, with_default_tool_prompt
from services.router.tools import plan_tools
from shared.errors import ConfigError, InvalidRequestError

TOOLS = [ToolDefinition.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}),
         ToolDefinition.model_validate({"type": "function", "function": {"name": "now"}})]


def feed_all(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in [*pieces, None]:
        r, c = parser.finish() if piece is None else parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("name", ["think", "gemma4"])
def test_reasoning_split_any_chunking(name: str) -> None:
    fmt = get_format(name)
    text = f"{fmt.start}step one < two{fmt.end}\n\nThe answer."
    for size in (1, 2, 3, 7, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert feed_all(ReasoningParser(fmt), pieces) == ("step one < two", "The answer.")
    # the template opened the section: the output starts inside it
    assert feed_all(ReasoningParser(fmt, thinking_at_start=True), [f"hmm{fmt.end}ok"]) == ("hmm", "ok")
    assert feed_all(ReasoningParser(fmt), ["No thinking here."]) == ("", "No thinking here.")
    assert feed_all(ReasoningParser(fmt), [f"{fmt.start}cut off by max_tok"]) == ("cut off by max_tok", "")
    with pytest.raises(ConfigError):
        get_format("nope")


def test_choice_output_reasoning_then_tools() -> None:
    out = ChoiceOutput(ReasoningParser(get_format("think")), get_parser("hermes").factory())
    message = MessageDelta()
    for piece in ["<think>I should call", " it</think>", "<tool_call>", '{"name": "now", "arguments": {}}',
                  "</tool_call>"]:
        message.extend(out.feed(piece))
    message.extend(out.finish())
    assert message.reasoning == "I should call it" and message.content == ""
    assert [(c.name, c.arguments) for c in out.calls] == [("now", {})]
    hidden = ChoiceOutput(ReasoningParser(get_format("think")), None, include_reasoning=False)
    assert hidden.feed("<think>x</think>y").reasoning == ""


def test_tool_plans() -> None:
    assert plan_tools(None, None, True, "hermes").mode == "none"
    assert plan_tools(TOOLS, "none", True, "hermes").prompt_tools is None
    auto = plan_tools(TOOLS, None, True, "hermes")
    assert auto.mode == "auto" and auto.grammar is None and len(auto.prompt_tools or []) == 2
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, "hermes")
    assert named.mode == "named" and named.grammar is not None
    assert json.loads(named.grammar.source)["required"] == ["city"]
    required = plan_tools(TOOLS, "required", False, "hermes")
    schema = json.loads(required.grammar.source)  # type: ignore[union-attr]
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Lund"}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls=false: one call
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, schema)
    with pytest.raises(jsonschema.ValidationError):  # the name picks the parameters
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    for bad in ("sometimes", {"type": "function", "function": {"name": "missing"}}, {"type": "function"}):
        with pytest.raises(InvalidRequestError) as e:
            plan_tools(TOOLS, bad, True, "hermes")
        assert e.value.param == "tool_choice"


def test_default_tool_prompt_renders_tools_calls_and_results() -> None:
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    messages = [
        {"role": "user", "content": "Weather in Lund?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lund"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
    ]
    out = with_default_tool_prompt(messages, [t.model_dump(exclude_none=True) for t in TOOLS])
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lund"}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
