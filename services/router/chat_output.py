"""One chat choice's output text to message parts: reasoning, content, tool calls.

    text ──► ReasoningParser (if configured) ──reasoning──► message.reasoning
                                             ──answer───► ToolCallParser (if tools) ──► content, tool_calls

The same pipeline serves streamed deltas and whole answers, so both agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.reasoning_parsers import ReasoningParser
from services.router.tool_parsers.base import CallDelta, ParsedCall, ParsedDelta, ToolCallParser


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: MessageDelta) -> MessageDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)
        return self

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.calls)


class ChoiceOutput:
    """Splits one choice's text; `calls` holds its finished tool calls."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None,
                 include_reasoning: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.include_reasoning = include_reasoning

    @property
    def calls(self) -> list[ParsedCall]:
        return self.tools.calls if self.tools is not None else []

    def _answer(self, reasoning: str, content: str, parsed: ParsedDelta | None) -> MessageDelta:
        if parsed is not None:
            content = parsed.content
        return MessageDelta(reasoning if self.include_reasoning else "", content,
                            parsed.calls if parsed is not None else [])

    def feed(self, text: str) -> MessageDelta:
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        parsed = self.tools.feed(content) if self.tools is not None else None
        return self._answer(reasoning, content, parsed)

    def finish(self) -> MessageDelta:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        if self.tools is None:
            return self._answer(reasoning, content, None)
        parsed = self.tools.feed(content).extend(self.tools.finish())
        return self._answer(reasoning, content, parsed)
