"""`tools` and `tool_choice` to a plan: what the prompt shows, what grammar forces, how output is read.

    tool_choice  none      tools left out of the prompt; output is plain content
                 auto      tools in the prompt; the configured parser (--tool-call-parser,
                           default hermes) finds calls in the output; the rest is content
                 required  a grammar forces a JSON list of {"name", "parameters"} objects, each
                           one of the tools with parameters valid for it (one call unless
                           parallel_tool_calls)
                 named     a grammar forces the arguments object of that one tool

`required` and named calls work with any model and template, even a 135M one that never
saw a tool: the output is the router's own JSON, read back by tool_parsers/forced.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from services.router.protocol import ToolDefinition
from services.router.tool_parsers.base import ToolCallParser, get_parser
from services.router.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from shared.errors import InvalidRequestError
from shared.structured.spec import GrammarSpec

ToolMode = Literal["none", "auto", "required", "named"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    prompt_tools: list[dict[str, Any]] | None = None  # what the template renders
    grammar: GrammarSpec | None = None
    named: str | None = None
    parser_name: str = "hermes"

    def parser(self) -> ToolCallParser | None:
        if self.mode == "none":
            return None
        if self.mode == "named":
            assert self.named is not None
            return NamedCallParser(self.named)
        if self.mode == "required":
            return RequiredCallsParser()
        return get_parser(self.parser_name).factory()

    @property
    def needs_special_tokens(self) -> bool:
        return self.mode == "auto" and get_parser(self.parser_name).needs_special_tokens


def parameters_of(tool: ToolDefinition) -> dict[str, Any]:
    parameters = tool.function.parameters
    if parameters is None:
        return EMPTY_PARAMETERS
    if parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"tool {tool.function.name!r}: parameters must be a JSON Schema of an object",
                                  param="tools")
    return parameters


def _named_choice(choice: dict[str, Any]) -> str:
    inner = choice.get("function")
    function: dict[str, Any] = inner if isinstance(inner, dict) else choice
    name = function.get("name") if choice.get("type", "function") == "function" else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError('tool_choice must be none, auto, required or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice")
    return name


def _required_grammar(tools: list[ToolDefinition], parallel: bool) -> GrammarSpec:
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": parameters_of(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def plan_tools(tools: list[ToolDefinition] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None, parser_name: str) -> ToolPlan:
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be unique", param="tools")
    for tool in tools:
        parameters_of(tool)
    prompt_tools = [t.model_dump(exclude_none=True) for t in tools]
    if tool_choice in (None, "auto"):
        get_parser(parser_name)
        return ToolPlan("auto", prompt_tools, parser_name=parser_name)
    if tool_choice == "none":
        return ToolPlan("none")
    if tool_choice == "required":
        return ToolPlan("required", prompt_tools, _required_grammar(tools, parallel_tool_calls is not False))
    if isinstance(tool_choice, str):
        raise InvalidRequestError(f"tool_choice {tool_choice!r} is not one of none, auto, required or a function",
                                  param="tool_choice")
    name = _named_choice(tool_choice)
    chosen = next((t for t in tools if t.function.name == name), None)
    if chosen is None:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools ({', '.join(names)})",
                                  param="tool_choice")
    grammar = GrammarSpec("json_schema", json.dumps(parameters_of(chosen), ensure_ascii=False))
    return ToolPlan("named", [chosen.model_dump(exclude_none=True)], grammar, named=name)
