"""Responses API request body, and its translation to a chat request.

    input: "text" | [items]        items: {"role", "content"} messages (input_text / output_text parts),
                                   {"type": "function_call", call_id, name, arguments},
                                   {"type": "function_call_output", call_id, output},
                                   {"type": "reasoning", content / summary}
    instructions ──► a system message first (not carried to later responses, as OpenAI does)
    tools [{"type": "function", name, parameters}] ──► chat tools; tool_choice likewise
    text.format {json_schema | json_object | text} ──► response_format
    max_output_tokens ──► max_completion_tokens
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from services.router.protocol import ChatCompletionRequest
from shared.errors import InvalidRequestError


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM
    seed: int | None = None
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True
    user: str | None = None


def _text_of(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            raise InvalidRequestError(f"this model reads text only: a {kind!r} input part cannot be given to it",
                                      param="input")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _content_of(content: Any) -> Any:
    """A message's content: text, or chat content parts when it holds images (`input_image`)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text_of(content)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not part.get("image_url"):
                raise InvalidRequestError("input_image parts need an image_url (file ids are not stored here)",
                                          param="input")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _text_of([part])})
    return parts


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (the API's dict form; `input_image` parts as `image_url` ones)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    pending_reasoning: str | None = None
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            message: dict[str, Any] = {"role": item.get("role", "user"), "content": _content_of(item.get("content"))}
            if message["role"] == "assistant" and pending_reasoning is not None:
                message["reasoning"], pending_reasoning = pending_reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or last.get("content"):
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            if pending_reasoning is not None:
                last["reasoning"], pending_reasoning = pending_reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning = _text_of(parts)
        else:
            raise InvalidRequestError(f"input items of type {kind!r} are not supported", param="input")
    return messages


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return {"type": fmt.get("type")}


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for tool in tools:
        if tool.get("type") != "function":
            raise InvalidRequestError(f"only function tools are supported, not {tool.get('type')!r}", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request this response runs, and the conversation (without instructions) it continues."""
    conversation = [*history, *input_messages(body.input)]
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    chat = {
        "model": body.model, "messages": messages, "tools": _tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "stream": body.stream, "include_reasoning": body.include_reasoning,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}), conversation
    except ValueError as e:
        raise InvalidRequestError(f"invalid input: {e}", param="input") from None


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
