"""A chat choice's output as a Responses API `response`: output items, and the stream's events.

    output: [reasoning item]? [message item (output_text)]? [function_call item]*
    stream: response.created, response.in_progress,
            per item: output_item.added ─► deltas (reasoning_text / output_text /
                      function_call_arguments) ─► ... at the end, per item: *.done, output_item.done
            response.completed (or incomplete: max_output_tokens) with usage
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from services.router.chat_output import MessageDelta
from services.router.endpoints.chat import ChatPlan, choice_output
from services.router.generation import Delta, PreparedRequest
from services.router.openai_format import Collected, usage
from services.router.responses.protocol import ResponsesRequest
from services.router.shapes import Usage
from services.router.tool_parsers.base import ParsedCall


class Event(BaseModel):
    """One stream event: its type, sequence number and whatever fields that type has."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "response"


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class _Item:
    """An output item being built: its JSON, and the text its deltas added."""

    body: dict[str, Any]
    text: str = ""
    call_index: int | None = None


@dataclass
class _Items:
    """Output items in order, growing as a choice's message deltas come."""

    items: list[_Item] = field(default_factory=list)
    calls: dict[int, _Item] = field(default_factory=dict)

    def _open(self, kind: str) -> _Item | None:
        last = self.items[-1] if self.items else None
        return last if last is not None and last.body["type"] == kind else None

    def add(self, message: MessageDelta, emit: Callable[..., None]) -> None:
        if message.reasoning:
            item = self._open("reasoning") or self._start(
                {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []}, emit)
            item.text += message.reasoning
            emit("response.reasoning_text.delta", item_id=item.body["id"], output_index=self.items.index(item),
                 content_index=0, delta=message.reasoning)
        if message.content:
            item = self._open("message") or self._start(
                {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []},
                emit, part=True)
            item.text += message.content
            emit("response.output_text.delta", item_id=item.body["id"], output_index=self.items.index(item),
                 content_index=0, delta=message.content, logprobs=[])
        for call in message.calls:
            if call.id is not None:
                self.calls[call.index] = self._start(
                    {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name,
                     "arguments": "", "status": "in_progress"}, emit)
            item = self.calls[call.index]
            if call.arguments:
                item.text += call.arguments
                emit("response.function_call_arguments.delta", item_id=item.body["id"],
                     output_index=self.items.index(item), delta=call.arguments)

    def _start(self, body: dict[str, Any], emit: Callable[..., None], part: bool = False) -> _Item:
        item = _Item(body)
        self.items.append(item)
        emit("response.output_item.added", output_index=len(self.items) - 1, item=dict(body))
        if part:
            emit("response.content_part.added", item_id=body["id"], output_index=len(self.items) - 1,
                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        return item

    def finish(self, calls: list[ParsedCall], emit: Callable[..., None]) -> list[dict[str, Any]]:
        """Complete every item (emitting the .done events); the final output list."""
        parsed = {call.id: call for call in calls}
        for index, item in enumerate(self.items):
            body, kind = item.body, item.body["type"]
            if kind == "reasoning":
                body["content"] = [{"type": "reasoning_text", "text": item.text}]
                emit("response.reasoning_text.done", item_id=body["id"], output_index=index, content_index=0,
                     text=item.text)
            elif kind == "message":
                part = {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}
                body.update(status="completed", content=[part])
                emit("response.output_text.done", item_id=body["id"], output_index=index, content_index=0,
                     text=item.text, logprobs=[])
                emit("response.content_part.done", item_id=body["id"], output_index=index, content_index=0, part=part)
            else:
                call = parsed.get(body["call_id"])
                body.update(status="completed", arguments=call.arguments_json if call else item.text)
                emit("response.function_call_arguments.done", item_id=body["id"], output_index=index,
                     arguments=body["arguments"])
            emit("response.output_item.done", output_index=index, item=body)
        return [item.body for item in self.items]


class ResponsesFormat:
    """Deltas of the one choice to a `response` object, or to Responses stream events."""

    def __init__(self, prepared: PreparedRequest, plan: ChatPlan, body: ResponsesRequest, model_name: str,
                 on_done: Callable[[list[dict[str, Any]]], None]) -> None:
        self.prepared = prepared
        self.body = body
        self.model_name = model_name
        self.on_done = on_done
        self.output = choice_output(plan)
        self.items = _Items()
        self._events: list[Event] = []
        self._sequence = 0
        self._finish_reason: str | None = None
        self._final_output: list[dict[str, Any]] = []

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append(Event.model_validate({"type": kind, "sequence_number": self._sequence, **fields}))
        self._sequence += 1

    def _take(self) -> list[BaseModel]:
        events, self._events = self._events, []
        return list(events)

    def _response(self, status: str, output: list[dict[str, Any]], used: Usage | None) -> ResponseBody:
        body = self.body
        length = self._finish_reason == "length"
        return ResponseBody.model_validate(dict(
            id=self.prepared.request_id, created_at=self.prepared.created, model=self.model_name,
            status="incomplete" if status == "completed" and length else status, output=output,
            incomplete_details={"reason": "max_output_tokens"} if length and status == "completed" else None,
            error=None, instructions=body.instructions, metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls is not False,
            tool_choice=body.tool_choice or "auto", tools=body.tools or [], temperature=body.temperature,
            top_p=body.top_p, max_output_tokens=body.max_output_tokens, previous_response_id=body.previous_response_id,
            text=body.text or {"format": {"type": "text"}}, store=body.store is not False,
            usage=None if used is None else _usage_json(used),
        ))

    def _finish(self) -> list[dict[str, Any]]:
        self.items.add(self.output.finish(), self._emit)
        output = self.items.finish(self.output.calls, self._emit)
        self.on_done(output)
        return output

    def response(self, result: Collected) -> BaseModel:
        choice = result.choices[0]
        self._finish_reason = choice.finish_reason
        self.items.add(self.output.feed(choice.text), self._emit)
        output = self._finish()
        self._events.clear()
        return self._response("completed", output, usage(self.prepared, result.num_tokens, result.num_cached_tokens))

    def start_chunks(self) -> list[BaseModel]:
        created = self._response("in_progress", [], None).model_dump()
        self._emit("response.created", response=created)
        self._emit("response.in_progress", response=created)
        return self._take()

    def chunks(self, delta: Delta) -> list[BaseModel]:
        self.items.add(self.output.feed(delta.text), self._emit)
        if delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason
            self._final_output = self._finish()
        return self._take()

    def usage_chunk(self, value: Usage) -> BaseModel:
        """The stream's last event: the whole response with its usage."""
        response = self._response("completed", self._final_output, value).model_dump()
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return Event.model_validate({"type": kind, "sequence_number": self._sequence, "response": response})


def _usage_json(used: Usage) -> dict[str, Any]:
    cached = used.prompt_tokens_details.cached_tokens if used.prompt_tokens_details else 0
    return {"input_tokens": used.prompt_tokens, "output_tokens": used.completion_tokens,
            "total_tokens": used.total_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}
