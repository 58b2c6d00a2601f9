"""Incremental detokenization and stop strings, on SmolLM2's real (byte-level BPE) tokenizer."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from services.router.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextStream, fast_decode
from shared.models.loader import resolve_model
from shared.tokenizer import decode, token_bytes

TEXTS = [
    "The capital of France is Paris.",
    "héllo wörld — naïve café, 世界你好! 🎉🎉 family: 👨‍👩‍👧 flags: 🇫🇷 math: ∑ x² ≥ 0",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, 日本語のテキスト, 한국어",
    "code:\n\tdef f(x):\n\t    return x  # comment   with   spaces\n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


def stream(tokenizer: Any, token_ids: Sequence[int], step: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]
    return [*pieces, detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_equals_full_decode(tokenizer: Any, text: str, step: int) -> None:
    ids = tokenizer(text).input_ids
    pieces = stream(tokenizer, ids, step)
    assert "".join(pieces) == decode(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces), "a piece of a multi-byte character was emitted"


def test_random_token_soup_equals_full_decode(tokenizer: Any) -> None:
    """Arbitrary ids (byte fragments, special tokens) still concatenate to the full decode."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
        assert "".join(stream(tokenizer, ids)) == decode(tokenizer, ids)


def test_the_rust_decode_is_used_where_it_equals_transformers_decode(tokenizer: Any) -> None:
    fast = fast_decode(tokenizer)
    assert fast is not None  # SmolLM2: TokenizersBackend's own _decode, no clean-up
    rng = random.Random(1)
    for skip in (True, False):
        for _ in range(50):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
            assert fast(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)

    class Decodes(type(tokenizer)):  # type: ignore[misc]  # a class with its own _decode keeps it
        def _decode(self, *args: Any, **kwargs: Any) -> str:
            return "x"
    assert fast_decode(Decodes.__new__(Decodes)) is None
    assert fast_decode(object()) is None


def test_split_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer("a🎉").input_ids
    emoji_ids = ids[1:]
    assert len(emoji_ids) > 1 and all(token_bytes(tokenizer, t) for t in emoji_ids)  # the emoji spans tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == "a"
    assert [detok.add([t]) for t in emoji_ids] == [""] * (len(emoji_ids) - 1) + ["🎉"]
    assert detok.flush() == ""


def test_a_batch_ending_inside_a_character_emits_the_text_before_it(tokenizer: Any) -> None:
    """A reply of two-byte characters one byte a token, streamed as the router gets it with a stream interval
    of 8: the first token alone, then 8 at a time, so every batch ends half-way through a character. Each
    batch shows the characters it finished; holding the whole batch showed the client nothing until the end."""
    # SmolLM2's byte tokens 162, 112 and 117 are 0xD7, 0xA2 and 0xA7: a served greedy reply to a random prompt
    ids = [162, 112] + [162, 117] * 40
    assert decode(tokenizer, ids) == "ע" + "ק" * 40
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[:1])] + [detok.add(ids[i : i + 8]) for i in range(1, len(ids), 8)]
    assert pieces[0] == ""  # half a character
    assert all(pieces[1:]), pieces
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + detok.flush() == decode(tokenizer, ids)


@pytest.mark.parametrize("step", [2, 5, 8])
def test_random_token_soup_in_batches_equals_full_decode(tokenizer: Any, step: int) -> None:
    """Batches that end inside characters (byte tokens among the ids) still add up to the full decode."""
    rng = random.Random(step)
    byte_tokens = [i for i in range(len(tokenizer)) if len(token_bytes(tokenizer, i)) == 1][:256]
    for _ in range(20):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.6 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 80))]
        assert "".join(stream(tokenizer, ids, step)) == decode(tokenizer, ids)


def test_flush_shows_an_unfinished_character_like_a_full_decode(tokenizer: Any) -> None:
    ids = tokenizer("ok 🎉").input_ids[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([t]) for t in ids) == "ok"
    assert detok.flush() == decode(tokenizer, ids)[len("ok") :]


def test_token_bytes_rebuild_the_text(tokenizer: Any) -> None:
    text = TEXTS[1]
    assert b"".join(token_bytes(tokenizer, t) for t in tokenizer(text).input_ids).decode() == text


# ---- stop strings -------------------------------------------------------------------------------------


def feed(matcher: StopStringMatcher, pieces: Sequence[str]) -> list[str]:
    return [matcher.feed(p) for p in pieces]


def test_stop_across_pieces_and_hold_back() -> None:
    m = StopStringMatcher(["END"])
    assert feed(m, ["the E", "N"]) == ["the ", ""]  # "E", then "EN" could start "END": held
    assert not m.stopped
    assert m.feed("D! more") == "" and m.stopped and m.matched == "END"
    assert m.feed("after") == "" and m.flush() == ""


def test_held_text_released_when_it_cannot_match() -> None:
    m = StopStringMatcher(["cd"])
    assert feed(m, ["abc", "x", "c"]) == ["ab", "cx", ""]
    assert m.flush() == "c"  # generation ended: the held tail is ordinary text
    assert not m.stopped


def test_earliest_of_several_stops_wins() -> None:
    m = StopStringMatcher(["world", "o"])
    assert m.feed("hello world") == "hell" and m.matched == "o"
    m = StopStringMatcher(["world", "o", "lo w"])
    assert m.feed("hello world") == "hel" and m.matched == "lo w"


def test_no_stop_strings_pass_through() -> None:
    m = StopStringMatcher([])
    assert feed(m, ["a", "b"]) == ["a", "b"] and m.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_stop_string_spanning_tokens(tokenizer: Any) -> None:
    text = "Hello world, this is a test of stop strings."
    ids = tokenizer(text).input_ids
    stop = "d, thi"  # starts inside " world" and ends inside " this"
    ts = TextStream(tokenizer, [stop])
    out = []
    for t in ids:
        delta = ts.add([t])
        out.append(delta.text)
        if delta.stopped:
            break
    assert "".join(out) == "Hello worl" and ts.stopped
    assert len(out) < len(ids)  # it stopped before the end of the tokens


def test_streamed_text_never_shows_a_stop_prefix_that_later_matches(tokenizer: Any) -> None:
    text = "alpha beta gamma delta"
    ids = tokenizer(text).input_ids
    ts = TextStream(tokenizer, ["gamma delta"])
    shown = ""
    for t in ids:
        shown += ts.add([t]).text
        assert "gam" not in shown
    assert shown == "alpha beta " and ts.stopped


def test_finish_releases_held_text(tokenizer: Any) -> None:
    ids = tokenizer("one two 🎉").input_ids[:-1]  # ends mid-character
    ts = TextStream(tokenizer, ["three"])
    text = "".join(ts.add([t]).text for t in ids)
    end = ts.finish()
    assert text + end.text == decode(tokenizer, ids) and not end.stopped
    ts = TextStream(tokenizer, ["two three"])
    assert ts.add(tokenizer("one two").input_ids).text == "one "  # " two" may start the stop string
    end = ts.finish()
    assert (end.text, end.stopped) == ("two", False)
