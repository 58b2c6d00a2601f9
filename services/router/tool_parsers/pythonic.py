"""Pythonic tool calls (Llama 3.2/4 "pythonic", many small models): a Python list of calls.

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

An output whose first non-space character is not '[' is content. The list is parsed
with `ast` once it closes (keyword arguments, literal values only); each call then goes
out whole: id and name, then its arguments in one fragment.
"""

from __future__ import annotations

import ast
import logging
from typing import Any

from services.router.tool_parsers.base import CallDelta, ParsedCall, ParsedDelta, new_call_id, register

logger = logging.getLogger(__name__)


def _list_end(text: str) -> int | None:
    """Index past the bracketed list starting at text[0]; None while it is open."""
    depth, quote, escaped = 0, "", False
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def parse_calls(source: str) -> list[tuple[str, dict[str, Any]]]:
    """[(name, arguments)] of a pythonic call list; ValueError/SyntaxError if it is not one."""
    tree = ast.parse(source.strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("each element must be name(keyword=value, ...)")
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        calls.append((node.func.id, arguments))
    return calls


class PythonicParser:
    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._buffer = ""
        self._mode: str | None = None

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        if self._mode is None:
            head = self._buffer.lstrip()
            if not head:
                return out
            self._mode = "calls" if head[0] == "[" else "content"
            self._buffer = head if self._mode == "calls" else self._buffer
        if self._mode == "content":
            out.content, self._buffer = self._buffer, ""
            return out
        end = _list_end(self._buffer)
        if end is not None:
            out.extend(self._close(self._buffer[:end]))
            self._mode, self._buffer = "content", self._buffer[end:]
            out.content += self._buffer
            self._buffer = ""
        return out

    def _close(self, source: str) -> ParsedDelta:
        out = ParsedDelta()
        try:
            parsed = parse_calls(source)
        except (ValueError, SyntaxError) as e:
            logger.info("pythonic tool calls did not parse (%s): kept as content", e)
            out.content = source
            return out
        for name, arguments in parsed:
            call = ParsedCall(new_call_id(), name, arguments)
            index = len(self.calls)
            self.calls.append(call)
            out.calls += [CallDelta(index, id=call.id, name=name), CallDelta(index, arguments=call.arguments_json)]
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta(content=self._buffer)
        self._buffer = ""
        return out


@register("pythonic")
def pythonic() -> PythonicParser:
    return PythonicParser()
