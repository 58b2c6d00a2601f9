"""POST /v1/responses: a Responses API request run as a chat request, answered as a `response`.

    body ─► [previous_response_id ─► the stored conversation] ─► to_chat ─► prepare_chat
         ─► Responder (JSON, or the Responses stream events) ─► store the conversation + this answer
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from services.router.chat_messages import media_parts
from services.router.endpoints.chat import prepare_chat
from services.router.media import fetch_remote_media
from services.router.metrics import RequestTimer
from services.router.model_context import ModelContext
from services.router.responses.format import ResponsesFormat
from services.router.responses.protocol import ResponsesRequest, to_chat
from services.router.responses.store import Conversation, ResponseStore
from services.router.serving import Responder, request_id
from shared.errors import InvalidRequestError


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer's output items as one assistant chat message (what a continuation renders)."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            message["content"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return message


class ResponsesEndpoint:
    def __init__(self, model: ModelContext, responder: Responder, store: ResponseStore) -> None:
        self.model = model
        self.responder = responder
        self.store = store

    async def _history(self, body: ResponsesRequest) -> Conversation:
        if body.previous_response_id is None:
            return []
        history = await self.store.get(body.previous_response_id)
        if history is None:
            raise InvalidRequestError(
                f"previous_response_id {body.previous_response_id!r} is unknown or expired (responses are kept for "
                f"{self.model.settings.responses_ttl_s:.0f} s, and only those created with store: true)",
                param="previous_response_id")
        return history

    async def handle(self, request: Request, body: ResponsesRequest, timer: RequestTimer) -> Response:
        chat, conversation = to_chat(body, await self._history(body))
        await fetch_remote_media(self.model.media, media_parts(chat.messages))
        prepared, plan = prepare_chat(chat, request_id(request), self.model)
        prepared = replace(prepared, include_usage=True)  # the last event (response.completed) carries it
        param = "text" if plan.grammar_param == "response_format" else plan.grammar_param
        await self.model.grammar.check(prepared.params.structured, param)

        def on_done(output: list[dict[str, Any]]) -> None:
            if body.store is not False:
                self.store.put(prepared.request_id, [*conversation, assistant_message(output)])

        fmt = ResponsesFormat(prepared, plan, body, self.model.name, on_done)
        return await self.responder.respond(request, prepared, fmt, timer)
