"""Chat messages as the API sends them, to the dicts chat templates read, and the prompt's tokens.

    content: "text" | [{"type": "text", "text": ...}, ...]   text parts joined with "\\n";
             image_url / input_audio parts become markers (media.py) for a model that reads them,
             a 400 for one that does not; file parts are a 400
    role "developer" ──► "system" (what OpenAI's newer clients send for instructions)
    assistant tool_calls ──► [{"id", "type": "function", "function": {"name", "arguments": {object}}}]
             (templates iterate the arguments as a mapping; a JSON string is parsed)
    assistant reasoning / reasoning_content ──► "reasoning_content" (the name templates read)

A template that does not render tools gets baton's default tool prompt (tool_prompt.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.router.media import MEDIA_PART_TYPES, PendingMedia, RouterMedia, expand_markers
from services.router.model_context import ModelContext
from services.router.protocol import ChatMessage, ContentPart, ToolCall
from services.router.tool_prompt import template_supports_tools, with_default_tool_prompt
from shared.errors import InvalidRequestError
from shared.multimodal.items import MediaItem
from shared.tokenizer import render_chat

TEXT_PART_TYPES = ("text", "input_text", "output_text")


def content_text(content: str | Sequence[ContentPart] | None, param: str = "messages",
                 media: RouterMedia | None = None, pending: PendingMedia | None = None) -> str:
    """The content as text; media parts become markers (`pending` collects them) when the model reads media."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type in MEDIA_PART_TYPES and media is not None and pending is not None:
            texts.append(media.add_part(part, pending, param))
            continue
        if part.type not in TEXT_PART_TYPES:
            raise InvalidRequestError(
                f"this model reads text only: a {part.type!r} content part cannot be given to it", param=param)
        if part.text is None:
            raise InvalidRequestError(f"a {part.type!r} content part needs its text", param=param)
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(call: ToolCall) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"tool call {call.function.name!r} has arguments that are not JSON: {e}",
                                      param="messages") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"tool call {call.function.name!r} arguments must be a JSON object",
                                  param="messages")
    return arguments


def message_dict(message: ChatMessage, media: RouterMedia | None = None,
                 pending: PendingMedia | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                             "content": content_text(message.content, "messages", media, pending)}
    if message.name:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": call.id or f"call_{i}", "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments(call)}}
            for i, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None:
        entry["reasoning_content"] = reasoning
    return entry


def message_dicts(messages: Sequence[ChatMessage], media: RouterMedia | None = None,
                  pending: PendingMedia | None = None) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    return [message_dict(m, media, pending) for m in messages]


def render_prompt(
    model: ModelContext, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
    add_generation_prompt: bool = True, continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as the model's template writes it (tools through the default prompt if need be)."""
    template = getattr(model.tokenizer, "chat_template", None)
    has_tool_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if (tools or has_tool_history) and template and not template_supports_tools(template):
        messages, tools = with_default_tool_prompt(messages, tools), None
    return render_chat(model.tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, template_kwargs=template_kwargs)


def encode_rendered(model: ModelContext, text: str, pending: PendingMedia | None = None
                    ) -> tuple[list[int], list[MediaItem]]:
    """The rendered conversation's tokens, with its media's placeholder runs where their markers were."""
    def tokenize(piece: str) -> list[int]:
        return list(model.tokenizer(piece, add_special_tokens=False).input_ids)

    if pending is not None and pending.kind and model.media is not None:
        token_ids, items = expand_markers(text, pending, model.media.config, tokenize)
    else:
        token_ids, items = tokenize(text), []
    if not token_ids:
        raise InvalidRequestError("the rendered conversation is empty", param="messages")
    return token_ids, items


def media_parts(messages: Sequence[ChatMessage]) -> list[ContentPart]:
    """Every media content part of a conversation (what `fetch_remote_media` looks at)."""
    return [part for m in messages if not isinstance(m.content, str | None) for part in m.content
            if part.type in MEDIA_PART_TYPES]
