"""Hermes-style tool calls (Qwen 2.5/3, Hermes, NousResearch): JSON inside <tool_call> tags.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content; any number of calls may follow each other. This is
also the format of baton's default tool prompt (tool_prompt.py) for templates that
have no tool support of their own.
"""

from __future__ import annotations

import logging

from services.router.tool_parsers.base import ParsedCall, ParsedDelta, held_prefix, register
from services.router.tool_parsers.json_call import JsonCallStream
from shared.errors import BatonError

logger = logging.getLogger(__name__)

START, END = "<tool_call>", "</tool_call>"


class TaggedJsonParser:
    """Content outside `start`…`end` tags, one JSON call object inside each pair."""

    def __init__(self, start: str = START, end: str = END) -> None:
        self.start, self.end = start, end
        self.calls: list[ParsedCall] = []
        self._buffer = ""  # text not yet given out: a partial start tag, or the current call's body
        self._call: JsonCallStream | None = None
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._buffer:
            if self._call is None:
                pos = self._buffer.find(self.start)
                if pos == -1:
                    keep = held_prefix(self._buffer, self.start)
                    out.content += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._buffer[:pos]
                self._buffer = self._buffer[pos + len(self.start):]
                self._call = JsonCallStream(self._num_calls)
                continue
            if not self._step_call(out):
                return out
        return out

    def _step_call(self, out: ParsedDelta) -> bool:
        """Advance the open call; True when it closed (the buffer holds what follows it)."""
        assert self._call is not None
        body = self._buffer.lstrip()
        closing = self._buffer.find(self.end)
        visible = body if closing == -1 else self._buffer[:closing].lstrip()
        if visible:
            out.calls.extend(self._call.update(visible))
        if closing == -1:
            return False
        self._finish_call(self._buffer[:closing].strip())
        self._buffer = self._buffer[closing + len(self.end):]
        return True

    def _finish_call(self, body: str) -> None:
        call, self._call = self._call, None
        assert call is not None
        self._num_calls += 1
        try:
            self.calls.append(call.parsed(body))
        except (BatonError, ValueError) as e:  # the model wrote something that is not a call
            logger.info("dropping a malformed tool call: %s", e)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._call is not None:  # the output ended inside a call: close it if its JSON is whole
            self._finish_call(self._buffer.strip())
        else:
            out.content = self._buffer
        self._buffer = ""
        return out


@register("hermes")
def hermes() -> TaggedJsonParser:
    return TaggedJsonParser()
