"""Reasoning parsers: split a model's thinking from its answer, registered by name.

    text ... ──feed──► (reasoning, content) ... ──finish──► the rest

    think   <think> ... </think> answer         (DeepSeek R1, Qwen 3, SmolLM3, ...)
    gemma4  <|channel>thought\\n ... <channel|> answer

A parser starts inside the thinking section when the prompt already opened it (the
chat template ended with the start marker), and outside it otherwise. The markers'
token ids become the `ReasoningSpec` the engine uses to apply a grammar only to the
answer and to enforce `thinking_token_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.tool_parsers.base import held_prefix
from shared.errors import ConfigError


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers of one model family's thinking section."""

    name: str
    start: str
    end: str
    special_tokens: bool = False  # the markers are special tokens (decode with them kept)


FORMATS = {
    "think": ReasoningFormat("think", "<think>", "</think>"),
    "gemma4": ReasoningFormat("gemma4", "<|channel>thought\n", "<channel|>", special_tokens=True),
}


def get_format(name: str) -> ReasoningFormat:
    if name not in FORMATS:
        raise ConfigError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]


class ReasoningParser:
    """One choice's output, split into reasoning and content as it streams."""

    def __init__(self, fmt: ReasoningFormat, thinking_at_start: bool = False) -> None:
        self.fmt = fmt
        self._state = "thinking" if thinking_at_start else "before"  # before | thinking | answer
        self._buffer = ""
        self._answer_started = False  # the newlines between the end marker and the answer are dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""
        self._buffer += text
        reasoning = content = ""
        while self._buffer and self._state != "answer":
            if self._state == "before":
                stripped = self._buffer.lstrip()
                if self.fmt.start.startswith(stripped):
                    return reasoning, content  # may still become the start marker
                if stripped.startswith(self.fmt.start):
                    self._state, self._buffer = "thinking", stripped[len(self.fmt.start):]
                else:
                    self._state = "answer"  # the model answered without thinking
                continue
            pos = self._buffer.find(self.fmt.end)
            if pos == -1:
                keep = held_prefix(self._buffer, self.fmt.end)
                reasoning += self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return reasoning, content
            reasoning += self._buffer[:pos]
            self._state, self._buffer = "answer", self._buffer[pos + len(self.fmt.end):]
        if self._state == "answer":
            content, self._buffer = self._answer(self._buffer), ""
        return reasoning, content

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip("\n")
            self._answer_started = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "thinking":
            return rest, ""  # the output ended while thinking (max_tokens)
        return "", self._answer(rest)
