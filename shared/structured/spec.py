"""What a request constrains its output to, as plain data that crosses every service.

A `GrammarSpec` names one kind of constraint and its source text; it is what the
router builds from `response_format`, vLLM's `structured_outputs`, or a forced tool
call, and what prefill and decode each compile (cached by the spec's hash) into a
matcher. Only the spec travels: a matcher's state is rebuilt on the far side of a
handoff by replaying the tokens emitted so far.

A `ReasoningSpec` tells the engine where a reasoning model's thinking section
starts and ends, so that a grammar applies only to the answer after it, and a
thinking-token budget can close the section by forcing its end tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import InvalidRequestError

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag")

# the longest source text a spec may carry (a schema, a grammar): bounded like any request field
MAX_GRAMMAR_SOURCE_CHARS = 256 * 1024


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint.

    kind:
        json_schema     source is a JSON Schema (text)
        json_object     any JSON object (source is ignored, "")
        regex           source is a regular expression the whole output matches
        choice          source is a JSON list of strings; the output is exactly one of them
        ebnf            source is an EBNF grammar (xgrammar's GBNF dialect, rule `root`)
        structural_tag  source is an xgrammar structural tag (JSON): free text with constrained
                        segments between trigger tags (tool calls inside prose)
    any_whitespace: JSON kinds only. False bounds the whitespace between JSON tokens (vLLM's
        `disable_any_whitespace`): small models fall into writing whitespace forever otherwise.
    """

    kind: str
    source: str = ""
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"unknown structured output kind {self.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}",
                param="structured_outputs",
            )
        if self.kind != "json_object" and not self.source:
            raise InvalidRequestError(f"structured output {self.kind!r} needs a non-empty source",
                                      param="structured_outputs")
        if len(self.source) > MAX_GRAMMAR_SOURCE_CHARS:
            raise InvalidRequestError(
                f"structured output source has {len(self.source)} characters; at most "
                f"{MAX_GRAMMAR_SOURCE_CHARS} are allowed", param="structured_outputs",
            )


@dataclass(frozen=True)
class ReasoningSpec:
    """Where a reasoning model thinks, in token ids (the router's reasoning parser knows them).

    start_token_ids / end_token_ids: the sequences that open and close the thinking section.
    thinking_at_start: the prompt already opened it (a template that ends in the start
        sequence), so the output begins inside it.
    budget: at most this many output tokens inside the section; when it runs out the engine
        forces `end_token_ids` and the answer follows (vLLM's `thinking_token_budget`).
        None: unbounded.
    A request's grammar (`SamplingParams.structured`) applies only after the section ends.
    """

    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    thinking_at_start: bool = False
    budget: int | None = None

    def __post_init__(self) -> None:
        if not self.start_token_ids or not self.end_token_ids:
            raise InvalidRequestError("a reasoning spec needs start and end token ids", param="reasoning")
        if self.budget is not None and self.budget < 0:
            raise InvalidRequestError(f"thinking_token_budget must be >= 0, got {self.budget}",
                                      param="thinking_token_budget")
