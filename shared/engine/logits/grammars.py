"""An engine's compiled grammars and the per-request states that use them.

    request arrives ──prepare(params) (caller's thread, off the engine loop)──► compiled, cached
    engine thread   ──new_state(request)──► RequestLogits with a fresh matcher (microseconds)

Compilation can take tens of milliseconds for a large schema; `prepare` runs it
where the request comes in (the service's gRPC handler) so that the engine loop
only ever finds it in the cache. A request whose spec was not prepared (a direct
engine call) compiles on first use.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import xgrammar as xgr

from shared.engine.logits.processor import bitmask_words
from shared.engine.logits.request_state import RequestLogits
from shared.engine.request import SamplingParams
from shared.errors import InvalidRequestError
from shared.structured.compiler import GrammarCompiler
from shared.structured.spec import GrammarSpec

__all__ = ["GrammarCache"]

MAX_CACHED_GRAMMARS = 256


class GrammarCache:
    """Compiled grammars of one engine by spec (LRU); makes its requests' logits states."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._compiled: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self) -> GrammarCompiler:
        if self._tokenizer is None:
            raise InvalidRequestError("this model was loaded without a tokenizer: structured outputs need one",
                                      param="structured_outputs")
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos_token_ids)
            return self._compiler

    def compiled(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (compiled now when not cached); thread-safe."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        compiled = self._get_compiler().compile(spec)  # outside the lock: it takes a while
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def prepare(self, params: SamplingParams) -> None:
        """Compile the request's grammar ahead of time; raises InvalidRequestError for a bad one."""
        if params.structured is not None:
            self.compiled(params.structured)

    def new_state(self, request_id: str, params: SamplingParams, prompt_token_ids: Sequence[int]
                  ) -> RequestLogits | None:
        """The request's logits state, or None when nothing about its logits needs processing."""
        if not params.processes_logits:
            return None
        if params.structured is None:
            return RequestLogits(request_id, params, prompt_token_ids, None)
        matcher = GrammarCompiler.new_matcher(self.compiled(params.structured))
        return RequestLogits(request_id, params, prompt_token_ids, matcher, self._get_compiler().utf8_guard,
                             bitmask_words(self._vocab_size))
