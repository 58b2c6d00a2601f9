"""Token ids to text as they stream, plus stop strings.

Incremental decoding (the windowed scheme of TGI and vLLM): decode a short window of
recent tokens twice, with and without the new ones, and emit the difference. A window
whose text ends in U+FFFD holds a partial multi-byte character (a byte-level BPE token
carries one or two bytes of an emoji); it is held until the character completes, so no
broken UTF-8 is ever emitted. `flush` at the end gives whatever is still held, exactly
as a full decode shows it. The concatenation of everything emitted equals
`tokenizer.decode(all_ids, skip_special_tokens=True)` (what `shared.tokenizer.decode` and
`baton generate` print).

Stop strings work on that text: the output ends just BEFORE the first match, and while
streaming, any tail that could be the start of a stop string is held back:

    stop = ["END"]      emitted so far   held     incoming
                        "the E"          ""       "N"       -> emits "the ", holds "EN"
                        "the "           "EN"     "D!"      -> match: emits nothing more, stopped
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
_MAX_HELD_TOKENS = 3  # the unfinished part of a character: at most 3 of its 4 bytes, one or more a token


def fast_decode(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """The Rust tokenizer's own decode when transformers' `decode` would return exactly its result.

    A streamed token is decoded twice; transformers' wrapper around the Rust call (argument conversion,
    batch checks, the clean-up rule) was most of the router's detokenizing time. It adds nothing when the
    tokenizer class keeps TokenizersBackend's `_decode` and no clean-up applies; otherwise (a subclass
    that decodes its own way, a WordPiece tokenizer that cleans up spaces) None: use `tokenizer.decode`."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend) or type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    backend: Any = tokenizer._tokenizer

    def decode(token_ids: list[int], skip_special_tokens: bool) -> str:
        return str(backend.decode(token_ids, skip_special_tokens=skip_special_tokens))
    return decode


class IncrementalDetokenizer:
    """Appends token ids, returns the text they complete."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._fast = fast_decode(tokenizer)
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start: context so that tokens decode as they do in the middle
        self._read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, token_ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(token_ids, self._skip_special_tokens)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)  # type: ignore[no-any-return]

    def add(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now complete (possibly "").

        Where the new tokens end inside a character, the text before that character goes now and only its
        tokens are held. Holding the whole batch instead locked a stream out: tokens arrive a batch at a time
        (the first alone, then stream_interval at once), and a reply of two-byte characters one byte a token
        (Hebrew, at 1 + 8k tokens) ended every batch mid-character, so the client saw nothing until the end.
        """
        self.token_ids.extend(token_ids)
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        # a UTF-8 character is at most 4 bytes, so its unfinished part is at most the last 3 tokens: only a text
        # ending in one is decoded again, a token shorter each time
        for end in range(len(self.token_ids), max(self._read_offset, len(self.token_ids) - _MAX_HELD_TOKENS - 1),
                         -1):
            full_text = self._decode(self.token_ids[self._prefix_offset : end])
            if full_text.endswith(REPLACEMENT_CHAR):
                continue
            if len(full_text) <= len(prefix_text):
                return ""  # nothing new yet
            self._prefix_offset = self._read_offset
            self._read_offset = end
            return full_text[len(prefix_text) :]
        return ""  # only an unfinished character

    def flush(self) -> str:
        """At the end of generation: the held text, incomplete characters shown as U+FFFD."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]


class StopStringMatcher:
    """Cuts streamed text before the first stop string; holds back a tail that may start one."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(stop)
        self.stopped = False
        self.matched: str | None = None
        self._held = ""

    def feed(self, text: str) -> str:
        """Text safe to emit now. After a match, `stopped` is True and nothing more is emitted."""
        if self.stopped:
            return ""
        buf = self._held + text
        if not self.stop:
            self._held = ""
            return buf
        match_pos, matched = len(buf), None
        for s in self.stop:
            pos = buf.find(s)
            if pos != -1 and pos < match_pos:
                match_pos, matched = pos, s
        if matched is not None:
            self.stopped, self.matched, self._held = True, matched, ""
            return buf[:match_pos]
        num_held = self._num_held(buf)
        self._held = buf[len(buf) - num_held :]
        return buf[: len(buf) - num_held]

    def _num_held(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        longest = min(len(buf), max(len(s) for s in self.stop) - 1)
        for n in range(longest, 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """At the end of generation with no match: the held-back tail is ordinary text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string matched: `text` ends before it and the request is over


class TextStream:
    """Incremental detokenization followed by stop-string matching, for one request."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), *, skip_special_tokens: bool = True) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.matcher = StopStringMatcher(stop)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def add(self, token_ids: Sequence[int]) -> TextDelta:
        text = self.matcher.feed(self.detokenizer.add(token_ids))
        return TextDelta(text, self.matcher.stopped)

    def finish(self) -> TextDelta:
        """The backend finished: emit what was held (a stop string may still match in it)."""
        text = self.matcher.feed(self.detokenizer.flush())
        text += self.matcher.flush()
        return TextDelta(text, self.matcher.stopped)
