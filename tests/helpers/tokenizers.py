"""Tokenizers for tests that need real token strings (grammars, templates) on the tiny random models.

`byte_tokenizer()` is a byte-level BPE with no merges: ids 0..2 are <pad>, <eos>, <bos> and ids
3..258 are the 256 bytes, so every text has exactly one encoding, one token per byte. The tiny
models use it with `vocab_size=BYTE_VOCAB` and eos id 1. Built offline in milliseconds.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

SPECIALS = ("<pad>", "<eos>", "<bos>")
BYTE_VOCAB = len(SPECIALS) + 256
# a ChatML-like template, enough for tests of the chat path (the packaged SmolLM2 has the real one)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@lru_cache(maxsize=1)
def byte_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's alphabet in byte order: the printable stand-in of byte b at id 3 + b
    by_byte = sorted(alphabet, key=_byte_of)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + b for b, ch in enumerate(by_byte)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel stand-in character encodes (GPT-2's table)."""
    from shared.tokenizer import _byte_level_alphabet

    return _byte_level_alphabet()[ch]
