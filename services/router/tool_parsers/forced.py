"""Parsers for outputs a grammar forced into a tool call (tool_choice required or a named function).

    named:     the whole output is the arguments object      {"city": "Paris"}
    required:  the whole output is a list of call objects    [{"name": "f", "parameters": {...}}, ...]

These formats are the router's own (the grammars in services/router/tools.py produce
them), so they work with any model and any chat template; the grammar guarantees the
arguments are an object that validates against the tool's parameters, unless the
output was cut short by max_tokens.
"""

from __future__ import annotations

import json
import logging

from services.router.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    ParsedDelta,
    arguments_object,
    new_call_id,
)
from services.router.tool_parsers.json_call import JsonCallStream
from shared.errors import BatonError

logger = logging.getLogger(__name__)


class NamedCallParser:
    """The output is the arguments of one call to `name`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = new_call_id()
        self.calls: list[ParsedCall] = []
        self._text = ""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._text and text:
            out.calls.append(CallDelta(0, id=self.id, name=self.name))
        self._text += text
        if text:
            out.calls.append(CallDelta(0, arguments=text))
        return out

    def finish(self) -> ParsedDelta:
        try:
            self.calls.append(ParsedCall(self.id, self.name, arguments_object(self._text)))
        except BatonError as e:
            logger.info("forced tool call %s has no complete arguments (%s)", self.name, e)
        return ParsedDelta()


class RequiredCallsParser:
    """The output is a JSON list of {"name", "parameters"} objects."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._text = ""
        self._pos = 0  # where the next element (or separator) starts
        self._call: JsonCallStream | None = None
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        out = ParsedDelta()
        while self._pos < len(self._text):
            if self._call is None:
                ch = self._text[self._pos]
                if ch in " \t\r\n,[]":
                    self._pos += 1
                    continue
                self._call = JsonCallStream(self._num_calls)
                self._num_calls += 1
            element = self._text[self._pos:]
            out.calls.extend(self._call.update(element))
            if self._call.malformed or not self._call.done:
                return out
            end = self._call.end or len(element)
            try:
                self.calls.append(self._call.parsed(element[:end]))
            except (BatonError, ValueError, json.JSONDecodeError) as e:
                logger.info("dropping a malformed forced tool call: %s", e)
            self._pos += end
            self._call = None
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta()
