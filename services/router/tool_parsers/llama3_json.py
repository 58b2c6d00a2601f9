"""Llama 3.1/3.2 JSON tool calls: the whole output is one or more call objects.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An output whose first non-space character (after the optional <|python_tag|>) is not
'{' is plain content. Calls are separated by ';' (or whitespace).
"""

from __future__ import annotations

import logging

from services.router.tool_parsers.base import ParsedCall, ParsedDelta, held_prefix, register
from services.router.tool_parsers.json_call import JsonCallStream
from shared.errors import BatonError

logger = logging.getLogger(__name__)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "content", "calls"
        self._call: JsonCallStream | None = None
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        if self._mode is None:
            self._decide()
        if self._mode == "content":
            out.content, self._buffer = self._buffer, ""
        elif self._mode == "calls":
            self._step_calls(out)
        return out

    def _decide(self) -> None:
        head = self._buffer.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):].lstrip()
        elif held_prefix(head, PYTHON_TAG) == len(head) and head:
            return  # maybe the tag, not complete yet
        if not head:
            return
        self._mode = "calls" if head[0] == "{" else "content"
        if self._mode == "calls":
            self._buffer = head

    def _step_calls(self, out: ParsedDelta) -> None:
        while True:
            self._buffer = self._buffer.lstrip(" \t\r\n;")
            if not self._buffer:
                return
            if self._call is None:
                if self._buffer[0] != "{":
                    out.content += self._buffer  # trailing prose after the calls
                    self._buffer = ""
                    return
                self._call = JsonCallStream(self._num_calls)
                self._num_calls += 1
            out.calls.extend(self._call.update(self._buffer))
            if self._call.malformed and self._call.name is None:  # not a call after all: prose
                self._mode, self._call = "content", None
                out.content, self._buffer = out.content + self._buffer, ""
                return
            if self._call.malformed or not self._call.done:
                return
            end = self._call.end or len(self._buffer)
            self._close(self._buffer[:end])
            self._buffer = self._buffer[end:]

    def _close(self, body: str) -> None:
        call, self._call = self._call, None
        assert call is not None
        try:
            self.calls.append(call.parsed(body))
        except (BatonError, ValueError) as e:
            logger.info("dropping a malformed tool call: %s", e)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode is None:
            self._mode = "content"
        if self._mode == "content" or self._call is None:
            out.content, self._buffer = self._buffer, ""
        else:
            if self._call.done:
                self._close(self._buffer)
            self._call, self._buffer = None, ""
        return out


@register("llama3_json")
def llama3_json() -> Llama3JsonParser:
    return Llama3JsonParser()
