"""Tool-call parsers: streamed in every split equals parsed whole, OpenAI's delta shape, malformed calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from services.router.tool_parsers.base import CallDelta, ParsedDelta, ToolCallParser, get_parser, parser_names
from services.router.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from services.router.tool_parsers.json_scan import scan_object, value_end
from shared.errors import ConfigError

WEATHER = {"city": "Paris", "days": 3, "units": {"temp": "C"}, "tags": ["a", "b,]}"], "ok": True}

CASES: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}\n</tool_call>',
     "Sure.", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {"x": "}"}, '
     '"name": "b"}</tool_call>', "\n", [("a", {}), ("b", {"x": "}"})]),
    ("hermes", "no calls here, just a < sign and <tool", "no calls here, just a < sign and <tool", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
     "", [("get_weather", WEATHER)]),
    ("llama3_json", '{"name": "a", "parameters": {"q": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", {"q": 1}), ("b", {})]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("pythonic", '[get_weather(city="Paris", days=3, units={"temp": "C"}), now()]', "",
     [("get_weather", {"city": "Paris", "days": 3, "units": {"temp": "C"}}), ("now", {})]),
    ("pythonic", "Just text [not a call", "Just text [not a call", []),
    ("gemma4", 'Let me look.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,units:{temp:<|"|>C<|"|>},'
     'tags:[<|"|>a<|"|>,1.5],ok:true}<tool_call|>', "Let me look.",
     [("get_weather", {"city": "Paris, FR", "days": 3, "units": {"temp": "C"}, "tags": ["a", 1.5], "ok": True})]),
]


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[CallDelta]]:
    out = ParsedDelta()
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return out.content, out.calls


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        step = rng.randint(1, 6)
        pieces.append(text[i:i + step])
        i += step
    return pieces


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_in_any_split_equals_whole(name: str, text: str, content: str,
                                            calls: list[tuple[str, dict[str, Any]]]) -> None:
    whole = get_parser(name).factory()
    got_content, _ = run(whole, [text])
    assert got_content == content
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    for seed in range(20):
        parser = get_parser(name).factory()
        streamed_content, deltas = run(parser, splits(text, seed))
        assert streamed_content == content
        assert [(c.name, c.arguments) for c in parser.calls] == calls
        # OpenAI's shape: per call, the first delta has id and name (no arguments yet), then fragments
        for index, (call_name, arguments) in enumerate(calls):
            mine = [d for d in deltas if d.index == index]
            assert mine[0].id and mine[0].name == call_name and mine[0].id == parser.calls[index].id
            assert all(d.id is None and d.name is None for d in mine[1:])
            assert json.loads("".join(d.arguments for d in mine)) == arguments


def test_forced_parsers() -> None:
    named = NamedCallParser("get_weather")
    content, deltas = run(named, splits(json.dumps(WEATHER), 1))
    assert content == "" and deltas[0].name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.arguments for d in deltas)) == WEATHER
    assert [(c.name, c.arguments) for c in named.calls] == [("get_weather", WEATHER)]
    required = RequiredCallsParser()
    text = json.dumps([{"name": "a", "parameters": WEATHER}, {"name": "b", "parameters": {}}])
    content, deltas = run(required, splits(text, 2))
    assert [(c.name, c.arguments) for c in required.calls] == [("a", WEATHER), ("b", {})]
    assert json.loads("".join(d.arguments for d in deltas if d.index == 0)) == WEATHER
    cut = NamedCallParser("f")  # max_tokens cut the arguments short: no parsed call
    run(cut, ['{"city": "Pa'])
    assert cut.calls == []


def test_json_scan_incomplete_and_malformed() -> None:
    assert value_end('"a\\"b" ', 0) == 6 and value_end('"open', 0) is None
    assert value_end("12", 0) is None and value_end("12,", 0) == 2
    scan = scan_object('{"name": "f", "arguments": {"a": [1, 2')
    assert scan.text_of('{"name": "f", "arguments": {"a": [1, 2', "name") == '"f"'
    assert scan.fields["arguments"][1] is None and scan.end is None and not scan.malformed
    assert scan_object("{name: 1}").malformed


def test_registry() -> None:
    assert {"hermes", "llama3_json", "pythonic", "gemma4"} <= set(parser_names())
    assert get_parser("gemma4").needs_special_tokens and not get_parser("hermes").needs_special_tokens
    with pytest.raises(ConfigError, match="unknown tool-call parser"):
        get_parser("nope")
