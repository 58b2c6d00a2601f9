"""Prompt text to token ids (plain or chat-templated) and token ids back to text."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from shared.errors import InvalidRequestError


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], chat_template: str | None = None, *,
    tools: Sequence[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Apply the chat template (the model's own unless one is given), by default with a generation prompt.

    `tools` reach templates that render them; `template_kwargs` are extra template variables
    (e.g. `enable_thinking`); `continue_final_message` leaves the last (assistant) turn open.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError(
            "this model has no chat template (it is a base model): send a plain prompt, or give a template"
        )
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                  param="continue_final_message")
    reserved = {"messages", "tools", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message"}
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in reserved}
    try:
        return tokenizer.apply_chat_template(
            list(messages), chat_template=template, tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **extra,
        )
    except InvalidRequestError:
        raise
    except Exception as e:  # jinja errors: the messages do not fit the template
        raise InvalidRequestError(f"chat template failed on these messages: {e}") from e


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = False, chat_template: str | None = None) -> list[int]:
    """Token ids of a prompt. A rendered chat template already carries its special tokens."""
    if chat:
        rendered = render_chat(tokenizer, [{"role": "user", "content": text}], chat_template)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], chat_template: str | None = None
) -> list[int]:
    """Token ids of a whole conversation, rendered with the chat template and a generation prompt."""
    rendered = render_chat(tokenizer, messages, chat_template)
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)


_BYTE_FALLBACK_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (byte-level BPE pieces use it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(getattr(backend, "decoder", None))


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token contributes to the text; a piece of a multi-byte character stays partial.

    What OpenAI's logprobs report as `bytes`. Byte-level BPE pieces map back through GPT-2's
    byte alphabet, SentencePiece byte-fallback pieces (`<0xE2>`) are one byte, and other
    pieces are their text with SentencePiece's `▁` as a space.
    """
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    if piece in getattr(tokenizer, "all_special_tokens", ()):
        return piece.encode("utf-8")
    byte_fallback = _BYTE_FALLBACK_PIECE.match(piece)
    if byte_fallback:
        return bytes([int(byte_fallback.group(1), 16)])
    if _is_byte_level(tokenizer):
        alphabet = _byte_level_alphabet()
        if all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode("utf-8")
