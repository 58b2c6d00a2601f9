"""The default tool prompt, for chat templates that know nothing of tools (SmolLM2's, for one).

With tools and a template that never reads `tools`, baton writes the tools into the
system message in the Hermes format, and the Hermes parser reads the calls back:

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    </tools>

    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

History goes the same way: an assistant turn's `tool_calls` become <tool_call> blocks in
its content, and a `tool` message becomes a user turn holding <tool_response> blocks.
"""

from __future__ import annotations

import json
from typing import Any

HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    return HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + FOOTER


def call_block(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def with_default_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                             ) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system turn, calls and results as text."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            blocks = [call_block(c["function"]["name"], c["function"]["arguments"]) for c in message.pop("tool_calls")]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        if message["role"] == "tool":
            response = "<tool_response>\n" + (message.get("content") or "") + "\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + response
                continue
            message = {"role": "user", "content": response, "_tool_responses": True}
        out.append(message)
    for message in out:
        message.pop("_tool_responses", None)
    if tools:
        prompt = tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0].get("content") or "") + "\n\n" + prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
