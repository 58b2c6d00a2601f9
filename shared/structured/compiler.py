"""GrammarSpec -> xgrammar CompiledGrammar, for one tokenizer and vocabulary.

    GrammarSpec ──compile (cached: xgrammar keys its cache by the source)──► CompiledGrammar
                                                                             └► new_matcher() per request

The router compiles each spec once to refuse a bad one with the compiler's own
message (400) before any service sees it; prefill and decode compile it again for
their own vocabulary width (the model's logits may be wider than the tokenizer),
off the engine loop, and hit xgrammar's cache from the second request on.

Whitespace: xgrammar's JSON grammars allow unbounded whitespace between tokens by
default, and small models fall into writing it forever. A spec with
`any_whitespace=False` (the default) gets fixed separators; one that asks for any
whitespace still gets at most `MAX_WHITESPACE` characters in a row.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from typing import Any

import xgrammar as xgr

from shared.errors import InvalidRequestError
from shared.structured.schema_fixes import bounded_strings_as_patterns
from shared.structured.spec import GrammarSpec
from shared.structured.utf8 import Utf8Guard

logger = logging.getLogger(__name__)

__all__ = ["GrammarCompiler", "choice_ebnf"]

MAX_WHITESPACE = 16
# xgrammar prefixes its messages with a time and a C++ source location: "[09:06:51] /project/cpp/x.cc:83: "
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def choice_ebnf(choices: Iterable[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's too)."""
    alternatives = [json.dumps(c, ensure_ascii=False) for c in choices]
    if not alternatives:
        raise InvalidRequestError("a choice constraint needs at least one choice", param="structured_outputs")
    return "root ::= " + " | ".join(alternatives)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer; thread-safe (xgrammar's compiler is)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None,
                 stop_token_ids: Iterable[int] | None = None, max_threads: int = 2) -> None:
        """`vocab_size`: the model's logits width when it exceeds the tokenizer's (bitmasks cover it).

        `stop_token_ids`: what the model emits when the grammar is complete (its eos ids).
        """
        stops = sorted(stop_token_ids) if stop_token_ids is not None else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=stops)
        self.vocab_size = self.tokenizer_info.vocab_size
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True)
        self._utf8_guard: Utf8Guard | None = None

    @property
    def utf8_guard(self) -> Utf8Guard:
        """Masks that keep the output valid UTF-8 beside the grammar's (see utf8.py); built on first use."""
        if self._utf8_guard is None:
            words = xgr.get_bitmask_shape(1, self.vocab_size)[1]
            self._utf8_guard = Utf8Guard(self.tokenizer_info.decoded_vocab, words)
        return self._utf8_guard

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar; a spec the compiler rejects is an InvalidRequestError with its message."""
        t0 = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own errors for bad sources
            message = _LOG_PREFIX.sub("", str(e).strip())
            raise InvalidRequestError(f"the {spec.kind} constraint does not compile: {message}",
                                      param="structured_outputs") from None
        logger.debug("compiled a %s grammar in %.1f ms", spec.kind, (time.perf_counter() - t0) * 1e3)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        json_options: dict[str, Any] = {"any_whitespace": spec.any_whitespace, "strict_mode": True}
        if spec.any_whitespace:
            json_options["max_whitespace_cnt"] = MAX_WHITESPACE
        if spec.kind == "json_schema":
            schema = bounded_strings_as_patterns(_check_json(spec.source, "json_schema"))
            return self._compiler.compile_json_schema(json.dumps(schema), **json_options)
        if spec.kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', **json_options)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.source)
        if spec.kind == "choice":
            choices = _check_json(spec.source, "choice")
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise InvalidRequestError("a choice constraint is a list of strings", param="structured_outputs")
            return self._compiler.compile_grammar(choice_ebnf(choices))
        if spec.kind == "ebnf":
            return self._compiler.compile_grammar(spec.source)
        assert spec.kind == "structural_tag", spec.kind
        _check_json(spec.source, "structural_tag")
        return self._compiler.compile_structural_tag(spec.source)

    @staticmethod
    def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A fresh matcher at the grammar's start (xgrammar 0.2 matchers roll back any number of tokens)."""
        return xgr.GrammarMatcher(compiled)


def _check_json(source: str, kind: str) -> Any:
    try:
        return json.loads(source)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"the {kind} constraint is not valid JSON: {e}",
                                  param="structured_outputs") from None
