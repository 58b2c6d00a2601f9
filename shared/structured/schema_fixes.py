"""JSON Schema rewrites that keep xgrammar 0.2.8's output valid JSON.

xgrammar lowers a string with `minLength`/`maxLength` to a bounded repetition of
`[^"\\\\\\r\\n]`, which admits raw control characters (U+0000-U+001F but CR/LF) that
JSON forbids inside strings: a tiny random model writes a form feed into a name
and `json.loads` refuses the result (upstream mlc-ai/xgrammar#800, open as of
2026-11, with fixes proposed in #822 and #880). Its `pattern` path is JSON-string
aware and refuses them, so a length-bounded string without a pattern or format of
its own becomes the equivalent pattern `^.{min,max}$` (length in characters, as
JSON Schema counts). Like xgrammar's own bounded strings, such a string cannot
hold escape sequences; every output it allows parses.
"""

from __future__ import annotations

from typing import Any

__all__ = ["bounded_strings_as_patterns"]


def bounded_strings_as_patterns(schema: Any) -> Any:
    """`schema` with every length-bounded plain string rewritten as a pattern (a new object; the input
    is not changed)."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^.{{{lo},{hi}}}$"
    return out
