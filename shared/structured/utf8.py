"""Token masks that keep constrained output valid UTF-8 where xgrammar 0.2.8's character classes are lax.

xgrammar matches a character class over UTF-8 bytes but takes an overlong three-byte form
(E0 80..9F xx) and an encoded surrogate (ED A0..BF xx) for a character, and likewise the
out-of-range four-byte forms after F0 and F4. Trained tokenizers seldom offer those
bytes one at a time; a byte-level vocabulary always does, and a sampling model then
writes text that no strict decoder (nor `json.loads` of its bytes) accepts. The byte
after each of those lead bytes has a narrower range than a plain continuation byte
(RFC 3629, section 4); this guard allows only tokens that start inside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Utf8Guard"]

# lead byte -> the range of the byte after it (inclusive), where it is narrower than 80..BF
_NEXT_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


class Utf8Guard:
    """Per lead byte, the token bitmask of tokens whose first byte may follow it."""

    def __init__(self, token_bytes: Sequence[bytes], num_words: int) -> None:
        """`token_bytes`: each token id's bytes (xgrammar's `TokenizerInfo.decoded_vocab`)."""
        self.token_bytes = token_bytes
        ids = torch.arange(num_words * 32)
        self.masks: dict[int, torch.Tensor] = {}
        for lead, (lo, hi) in _NEXT_BYTE.items():
            allowed = torch.zeros(num_words * 32, dtype=torch.bool)
            ok = [i for i, b in enumerate(token_bytes) if b and lo <= b[0] <= hi]
            allowed[ok] = True
            bits = allowed.view(num_words, 32).int() << (ids[:32].int())
            self.masks[lead] = bits.sum(dim=1, dtype=torch.int64).to(torch.int32)  # [num_words]

    def restrict(self, last_token_id: int | None, bitmask_row: torch.Tensor) -> None:
        """AND `bitmask_row` ([words] int32) with what may follow a token ending in a narrowing lead byte."""
        if last_token_id is None or not 0 <= last_token_id < len(self.token_bytes):
            return
        last = self.token_bytes[last_token_id]
        if last and last[-1] in self.masks:
            bitmask_row &= self.masks[last[-1]]
