"""Prompt text to token ids (plain or chat-templated) and token ids back to text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.errors import InvalidRequestError


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], chat_template: str | None = None
) -> str:
    """Apply the chat template (the model's own unless one is given) with a generation prompt."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError(
            "this model has no chat template (it is a base model): send a plain prompt, or give a template"
        )
    try:
        return tokenizer.apply_chat_template(
            list(messages), chat_template=template, add_generation_prompt=True, tokenize=False
        )
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
