"""Where JSON values and object fields end in text that is still streaming in.

The tool-call parsers see a call's JSON grow a few characters at a time; these scans
tell, on each growth, which fields are complete and where the `arguments` value starts
and (once known) ends, so its text can stream out as fragments whose concatenation is
exactly that value. An incomplete scan is not an error: it only says "not yet".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index past the JSON string starting at text[i] ('"'); None while it is open."""
    escaped = False
    for j in range(i + 1, len(text)):
        ch = text[j]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return j + 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index past the JSON value starting at text[i]; None while it may still grow."""
    first = text[i]
    if first == '"':
        return string_end(text, i)
    if first in "{[":
        depth, in_string, escaped = 0, False, False
        for j in range(i, len(text)):
            ch = text[j]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None  # a number or literal is complete once a delimiter follows


@dataclass
class ObjectScan:
    """What is known of a JSON object whose text may be incomplete."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # key -> (value start, end)
    end: int | None = None  # index past the closing brace, once seen
    malformed: bool = False  # the text cannot be the start of an object

    def text_of(self, text: str, key: str) -> str | None:
        """The complete value text of `key`, or None."""
        span = self.fields.get(key)
        if span is None or span[1] is None:
            return None
        return text[span[0]:span[1]]


def scan_object(text: str, i: int = 0) -> ObjectScan:
    """Scan the object starting at text[i] ('{') as far as the text goes."""
    scan = ObjectScan()
    if i >= len(text) or text[i] != "{":
        scan.malformed = True
        return scan
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] != '"':
            scan.malformed = True
            return scan
        key_end = string_end(text, j)
        if key_end is None:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            scan.malformed = True
            return scan
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return scan
        end = value_end(text, j)
        scan.fields[key] = (j, end)
        if end is None:
            return scan
        j = skip_ws(text, end)
        if j >= len(text):
            return scan
        if text[j] == ",":
            j = skip_ws(text, j + 1)
        elif text[j] != "}":
            scan.malformed = True
            return scan
    return scan
