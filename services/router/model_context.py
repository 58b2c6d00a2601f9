"""What the endpoints know about the one model served: tokenizer, settings, defaults, parsers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.router.media import RouterMedia
from services.router.reasoning_parsers import ReasoningFormat, get_format
from services.router.settings import RouterSettings
from services.router.structured import GrammarChecker
from services.router.tool_parsers.base import get_parser
from shared.errors import InvalidRequestError
from shared.models.generation_config import GenerationDefaults


@dataclass
class ModelContext:
    """The served model as the router sees it (no weights): built once at startup."""

    name: str
    tokenizer: Any
    settings: RouterSettings
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    media: RouterMedia | None = None  # a model that reads images or audio (media.py); None: text only

    def __post_init__(self) -> None:
        self.grammar = GrammarChecker(self.tokenizer, self._eos_token_ids(), self.settings.max_schema_bytes)
        self.reasoning: ReasoningFormat | None = (
            get_format(self.settings.reasoning_parser) if self.settings.reasoning_parser else None)
        get_parser(self.tool_parser)  # an unknown name fails at startup, not per request

    @property
    def tool_parser(self) -> str:
        return self.settings.tool_call_parser or "hermes"

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.settings.max_model_len

    def _eos_token_ids(self) -> list[int] | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if isinstance(eos, int) else None

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})", param=param)

    def marker_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False).input_ids)
