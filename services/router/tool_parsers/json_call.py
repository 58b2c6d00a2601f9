"""One tool call written as a JSON object ({"name": ..., "arguments": {...}}), streamed.

    {"name": "get_weather", "arguments": {"city": "Paris"}}
     └─ name complete ──► CallDelta(id, name)   └─ value text as it grows ──► CallDelta(arguments=...)

Argument fragments are the raw value text, so they concatenate to exactly what the model
wrote; the parsed call (for non-streamed answers) re-serializes the object. Models write
the arguments under "arguments" (Hermes) or "parameters" (Llama 3).
"""

from __future__ import annotations

import json

from services.router.tool_parsers.base import CallDelta, ParsedCall, arguments_object, new_call_id
from services.router.tool_parsers.json_scan import scan_object
from shared.errors import InvalidRequestError

ARGUMENT_KEYS = ("arguments", "parameters")


class JsonCallStream:
    """Tracks one call object's text; `update` returns what became known since the last call."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.name: str | None = None
        self._num_args_sent = 0
        self.done = False
        self.malformed = False
        self.end: int | None = None  # index past the object in the text given, once complete

    def update(self, text: str) -> list[CallDelta]:
        """`text`: the call's JSON so far, starting at its '{'."""
        scan = scan_object(text)
        if scan.malformed:
            self.malformed = True
            return []
        out: list[CallDelta] = []
        if self.name is None:
            name_text = scan.text_of(text, "name")
            if name_text is not None:
                name = json.loads(name_text)
                if not isinstance(name, str) or not name:
                    self.malformed = True
                    return []
                self.name = name
                out.append(CallDelta(self.index, id=self.id, name=name))
        key = next((k for k in ARGUMENT_KEYS if k in scan.fields), None)
        if self.name is not None and key is not None:
            start, end = scan.fields[key]
            value = text[start:end if end is not None else len(text)]
            if len(value) > self._num_args_sent:
                out.append(CallDelta(self.index, arguments=value[self._num_args_sent:]))
                self._num_args_sent = len(value)
        if scan.end is not None:
            self.done, self.end = True, scan.end
        return out

    def parsed(self, text: str) -> ParsedCall:
        """The complete call (after `done`); InvalidRequestError if it is not a valid call."""
        scan = scan_object(text)
        key = next((k for k in ARGUMENT_KEYS if k in scan.fields), None)
        if self.name is None:
            raise InvalidRequestError("tool call without a name")
        arguments = arguments_object(json.loads(scan.text_of(text, key) or "{}") if key else {})
        return ParsedCall(self.id, self.name, arguments)
