"""shared.structured.compiler: every spec kind compiles for a real tokenizer, bad sources are 400s."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from shared.errors import InvalidRequestError
from shared.structured.compiler import GrammarCompiler
from shared.structured.spec import GrammarSpec
from tests.helpers.tokenizers import BYTE_VOCAB, byte_tokenizer

EOS = 1


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(byte_tokenizer(), vocab_size=BYTE_VOCAB, stop_token_ids=[EOS])


def _walk(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> xgr.GrammarMatcher:
    """A matcher for `spec` that has accepted `text` byte by byte (asserting each is allowed)."""
    matcher = compiler.new_matcher(compiler.compile(spec))
    for token_id in byte_tokenizer()(text, add_special_tokens=False).input_ids:
        assert matcher.accept_token(token_id), (spec.kind, text, token_id)
    return matcher


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, '
                                    '"required": ["a"]}'), '{"a": 12}'),
        (GrammarSpec("json_object"), '{"k": [1, "x"]}'),
        (GrammarSpec("regex", r"\d{3}-[a-z]{3}"), "123-abc"),
        (GrammarSpec("choice", '["yes", "no \\"quoted\\""]'), 'no "quoted"'),
        (GrammarSpec("ebnf", 'root ::= "a" b\nb ::= "b"+'), "abbb"),
        (GrammarSpec("structural_tag", '{"type": "structural_tag", "format": {"type": "const_string", '
                                       '"value": "hi"}}'), "hi"),
    ],
)
def test_each_kind_accepts_its_language_then_only_eos(compiler: GrammarCompiler, spec: GrammarSpec,
                                                      text: str) -> None:
    matcher = _walk(compiler, spec, text)
    mask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    allowed = [i for i in range(compiler.vocab_size) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
    if spec.kind == "ebnf":  # "b"+ may go on
        assert set(allowed) == {EOS, 3 + ord("b")}
    else:
        assert allowed == [EOS]


def test_whitespace_is_bounded_by_default(compiler: GrammarCompiler) -> None:
    matcher = _walk(compiler, GrammarSpec("json_object"), "{")
    assert not matcher.accept_token(3 + ord(" "))  # fixed separators: no space after '{'
    loose = _walk(compiler, GrammarSpec("json_object", any_whitespace=True), "{" + " " * 16)
    assert not loose.accept_token(3 + ord(" "))  # a 17th space in a row is refused


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("regex", "(unclosed"), "parenthesis is not closed"),
        (GrammarSpec("json_schema", '{"type": "objectx"}'), "objectx"),
        (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (GrammarSpec("choice", '["a", 1]'), "list of strings"),
        (GrammarSpec("ebnf", "root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_bad_sources_are_invalid_requests_with_the_compilers_message(compiler: GrammarCompiler,
                                                                     spec: GrammarSpec, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    assert message in info.value.message and info.value.param == "structured_outputs"
    assert not info.value.message.startswith("[")  # xgrammar's log prefix is stripped


def test_spec_validation() -> None:
    with pytest.raises(InvalidRequestError, match="unknown structured output kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(InvalidRequestError, match="non-empty source"):
        GrammarSpec("regex")


def test_length_bounded_strings_never_hold_raw_control_characters(compiler: GrammarCompiler) -> None:
    """xgrammar's own bounded strings admit a raw form feed (mlc-ai/xgrammar#800): ours must not."""
    spec = GrammarSpec("json_schema", '{"type": "object", "properties": {"s": {"type": "string", "minLength": 1, '
                                      '"maxLength": 3}}, "required": ["s"]}')
    matcher = _walk(compiler, spec, '{"s": "')
    for byte in range(0x20):
        assert not matcher.accept_token(3 + byte), hex(byte)
    matcher = _walk(compiler, spec, '{"s": "abc')
    assert not matcher.accept_token(3 + ord("d"))  # the bound still holds
    assert matcher.accept_token(3 + ord('"'))


def test_utf8_guard_refuses_overlong_and_surrogate_forms(compiler: GrammarCompiler) -> None:
    """xgrammar takes E0 8B B7 (overlong) and ED A0 80 (a surrogate) for characters; the guard does not."""
    guard = compiler.utf8_guard
    for lead, bad, good in [(0xE0, 0x8B, 0xA0), (0xED, 0xA0, 0x9F), (0xF0, 0x8F, 0x90), (0xF4, 0x90, 0x8F)]:
        row = torch.full((xgr.get_bitmask_shape(1, compiler.vocab_size)[1],), -1, dtype=torch.int32)
        guard.restrict(3 + lead, row)
        allowed = {i for i in range(compiler.vocab_size) if (int(row[i // 32]) >> (i % 32)) & 1}
        assert 3 + good in allowed and 3 + bad not in allowed and 3 + ord("a") not in allowed, hex(lead)
    row = torch.full((8,), -1, dtype=torch.int32)
    guard.restrict(3 + 0xC3, row)  # an ordinary lead byte: the grammar's own mask stands
    assert row.tolist() == [-1] * 8
