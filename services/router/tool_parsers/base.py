"""What a tool-call parser is: model output text in, content and tool calls out, as it streams.

    text ... ──feed──► ParsedDelta(content, calls=[CallDelta ...]) ... ──finish──► the rest
    calls: the first CallDelta of call k carries its id and name; later ones add argument
           fragments whose concatenation is the call's arguments (a JSON object's text)

A parser keeps back text that may be the start of a tool call (a partial start tag)
until it knows. `calls` holds every completed call with its arguments parsed, for the
non-streamed answer. Parsers are registered by name (`--tool-call-parser`,
`BATON_ROUTER_TOOL_CALL_PARSER`); each lives in its own module.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.errors import ConfigError, InvalidRequestError


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class CallDelta:
    """A piece of tool call number `index`: id and name on its first piece, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


class ToolCallParser(Protocol):
    """One choice's output, split into content and tool calls as it streams."""

    calls: list[ParsedCall]

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


@dataclass(frozen=True)
class ToolParserInfo:
    """A registered parser: how to build one, and what the model's output must keep for it."""

    factory: Callable[[], ToolCallParser]
    needs_special_tokens: bool = False  # its markers are special tokens (kept in the text for it)


_REGISTRY: dict[str, ToolParserInfo] = {}


def register(name: str, needs_special_tokens: bool = False) -> Callable[[Callable[[], ToolCallParser]],
                                                                        Callable[[], ToolCallParser]]:
    def add(factory: Callable[[], ToolCallParser]) -> Callable[[], ToolCallParser]:
        _REGISTRY[name] = ToolParserInfo(factory, needs_special_tokens)
        return factory

    return add


def get_parser(name: str) -> ToolParserInfo:
    from services.router.tool_parsers import load_all

    load_all()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def parser_names() -> list[str]:
    from services.router.tool_parsers import load_all

    load_all()
    return sorted(_REGISTRY)


def arguments_object(value: Any) -> dict[str, Any]:
    """A call's arguments as an object: JSON text inside a string is parsed (some models write that)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InvalidRequestError("tool call arguments are not JSON") from None
    if not isinstance(value, dict):
        raise InvalidRequestError("tool call arguments are not a JSON object")
    return value


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (kept back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
