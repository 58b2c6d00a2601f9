"""Request fields that constrain the output, to one `GrammarSpec`; compiled once here for a clear 400.

    response_format {"type": "json_object"}                       ──► json_object
    response_format {"type": "json_schema", "json_schema": {...}} ──► json_schema (its "schema")
    response_format {"type": "structural_tag", ...}               ──► structural_tag (vLLM)
    structured_outputs {json | regex | choice | grammar | structural_tag | json_object} (vLLM)
    tool_choice required / named function                         ──► json_schema (tools.py builds it)

At most one constraint per request. `GrammarChecker.check` compiles a spec with
xgrammar off the event loop, so a schema or grammar that does not compile is refused
with the compiler's own message before any service sees it (xgrammar caches compiled
grammars by source, so the cost is paid once per distinct schema).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from services.router.engine_features import STRUCTURED_OUTPUTS, require
from services.router.protocol import SamplingRequest, StructuredOutputs
from shared.errors import InvalidRequestError
from shared.structured.spec import GrammarSpec


def _source(value: dict[str, Any] | list[Any] | str, param: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{param} is not JSON: {e}", param=param) from None


def from_response_format(response_format: dict[str, Any]) -> GrammarSpec | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        if not isinstance(wrapper, dict):
            raise InvalidRequestError("response_format json_schema needs a json_schema object",
                                      param="response_format")
        schema = wrapper.get("schema", wrapper.get("json_schema"))
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON Schema object",
                                      param="response_format")
        return GrammarSpec("json_schema", _source(schema, "response_format"))
    if kind == "structural_tag":
        return GrammarSpec("structural_tag", _source(response_format, "response_format"))
    raise InvalidRequestError(
        f"response_format type {kind!r} is not one of text, json_object, json_schema, structural_tag",
        param="response_format",
    )


def from_structured_outputs(so: StructuredOutputs) -> GrammarSpec | None:
    given: list[tuple[str, str]] = []
    if so.json_ is not None:
        given.append(("json_schema", _source(so.json_, "structured_outputs")))
    if so.regex is not None:
        given.append(("regex", so.regex))
    if so.choice is not None:
        given.append(("choice", _source(so.choice, "structured_outputs")))
    if so.grammar is not None:
        given.append(("ebnf", so.grammar))
    if so.structural_tag is not None:
        given.append(("structural_tag", _source(so.structural_tag, "structured_outputs")))
    if so.json_object:
        given.append(("json_object", ""))
    if len(given) > 1:
        raise InvalidRequestError("structured_outputs takes one of json, regex, choice, grammar, structural_tag, "
                                  "json_object", param="structured_outputs")
    if not given:
        return None
    kind, source = given[0]
    return GrammarSpec(kind, source, any_whitespace=so.disable_any_whitespace is False)


def grammar_from_body(body: SamplingRequest) -> GrammarSpec | None:
    """The one output constraint the body asks for, if any."""
    specs = []
    if body.response_format:
        specs.append(("response_format", from_response_format(body.response_format)))
    if body.structured_outputs is not None:
        specs.append(("structured_outputs", from_structured_outputs(body.structured_outputs)))
    specs = [(param, spec) for param, spec in specs if spec is not None]
    if len(specs) > 1:
        raise InvalidRequestError("give response_format or structured_outputs, not both", param="response_format")
    return specs[0][1] if specs else None


class GrammarChecker:
    """Compiles specs for the served tokenizer (built on first use, in a worker thread)."""

    def __init__(self, tokenizer: Any, stop_token_ids: list[int] | None = None, max_source_bytes: int = 0) -> None:
        """`max_source_bytes`: the largest schema or grammar accepted (0 = any): compiling one costs time and
        memory that grow with it."""
        self._tokenizer = tokenizer
        self._stop_token_ids = stop_token_ids
        self._max_source_bytes = max_source_bytes
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _compile(self, spec: GrammarSpec) -> None:
        from shared.structured.compiler import GrammarCompiler

        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, stop_token_ids=self._stop_token_ids)
        self._compiler.compile(spec)

    async def check(self, spec: GrammarSpec | None, param: str) -> None:
        """400 with the compiler's message if `spec` does not compile, or if the engines cannot apply it."""
        if spec is None:
            return
        size = len(spec.source.encode())
        if self._max_source_bytes and size > self._max_source_bytes:
            raise InvalidRequestError(f"{param}: the schema or grammar has {size} bytes; at most "
                                      f"{self._max_source_bytes} are accepted", param=param)
        try:
            await asyncio.to_thread(self._compile, spec)
        except InvalidRequestError as e:
            raise InvalidRequestError(e.message, param=param) from None
        require(STRUCTURED_OUTPUTS, param, f"{param} (grammar-constrained output)")
