"""Gemma 4 tool calls: special-token tags around a call written in Gemma's own object syntax.

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{temp:<|"|>C<|"|>}}<tool_call|>

Keys are bare, strings sit between <|"|> markers (no escapes inside), numbers, booleans,
null, nested objects and lists are as in JSON (the structural tag xgrammar 0.2.8 ships
for Gemma 4 shows the tags). The tags are special tokens, so the text this parser sees
is decoded with special tokens kept. Each call goes out whole once its end tag arrives.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from services.router.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    ParsedDelta,
    held_prefix,
    new_call_id,
    register,
)

logger = logging.getLogger(__name__)

START, END, CALL_PREFIX, QUOTE = "<|tool_call>", "<tool_call|>", "call:", '<|"|>'


class _Reader:
    """A recursive-descent reader of Gemma's object syntax."""

    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def _ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t\r\n":
            self.i += 1

    def value(self) -> Any:
        self._ws()
        text = self.text
        if text.startswith(QUOTE, self.i):
            end = text.find(QUOTE, self.i + len(QUOTE))
            if end == -1:
                raise ValueError("unterminated string")
            out = text[self.i + len(QUOTE):end]
            self.i = end + len(QUOTE)
            return out
        if text.startswith("{", self.i):
            return self._container("}", keyed=True)
        if text.startswith("[", self.i):
            return self._container("]", keyed=False)
        start = self.i
        while self.i < len(text) and text[self.i] not in ",}] \t\r\n":
            self.i += 1
        return json.loads(text[start:self.i])  # number, true, false, null

    def _container(self, close: str, keyed: bool) -> Any:
        self.i += 1
        items: Any = {} if keyed else []
        while True:
            self._ws()
            if self.text.startswith(close, self.i):
                self.i += 1
                return items
            if keyed:
                colon = self.text.find(":", self.i)
                if colon == -1:
                    raise ValueError("a key without a value")
                key = self.text[self.i:colon].strip().removeprefix(QUOTE).removesuffix(QUOTE)
                self.i = colon + 1
                items[key] = self.value()
            else:
                items.append(self.value())
            self._ws()
            if self.text.startswith(",", self.i):
                self.i += 1
            elif not self.text.startswith(close, self.i):
                raise ValueError(f"expected ',' or {close!r} at {self.i}")


def parse_call(body: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of `call:name{...}`; ValueError if it is not one."""
    body = body.strip()
    if not body.startswith(CALL_PREFIX) or "{" not in body:
        raise ValueError("expected call:name{...}")
    brace = body.index("{")
    name = body[len(CALL_PREFIX):brace].strip()
    reader = _Reader(body[brace:])
    arguments = reader.value()
    if not name or not isinstance(arguments, dict) or body[brace + reader.i:].strip():
        raise ValueError("expected call:name{...}")
    return name, arguments


class Gemma4Parser:
    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._buffer:
            marker = END if self._in_call else START
            pos = self._buffer.find(marker)
            if pos == -1:
                if not self._in_call:
                    keep = held_prefix(self._buffer, START)
                    out.content += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            if self._in_call:
                out.extend(self._close(self._buffer[:pos]))
            else:
                out.content += self._buffer[:pos]
            self._buffer = self._buffer[pos + len(marker):]
            self._in_call = not self._in_call
        return out

    def _close(self, body: str) -> ParsedDelta:
        try:
            name, arguments = parse_call(body)
        except (ValueError, json.JSONDecodeError) as e:
            logger.info("dropping a malformed Gemma 4 tool call: %s", e)
            return ParsedDelta()
        call = ParsedCall(new_call_id(), name, arguments)
        index = len(self.calls)
        self.calls.append(call)
        return ParsedDelta(calls=[CallDelta(index, id=call.id, name=name), CallDelta(index, arguments=call.arguments_json)])

    def finish(self) -> ParsedDelta:
        out = ParsedDelta() if self._in_call else ParsedDelta(content=self._buffer)
        if self._in_call:
            out.extend(self._close(self._buffer))
        self._buffer, self._in_call = "", False
        return out


@register("gemma4", needs_special_tokens=True)
def gemma4() -> Gemma4Parser:
    return Gemma4Parser()
