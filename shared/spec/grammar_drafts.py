"""Grammar fast-forward: the tokens a request's grammar forces next, drafted for free.

Where a JSON schema fixes the next characters (a key, its quotes and colon, the
punctuation between fields), the model has no choice to make: xgrammar's
`find_jump_forward_string` gives that text. Tokenized and handed to verification as
drafts, one forward pass accepts the whole run instead of one token per step; the
grammar mask at each draft position keeps the output exact (a draft the model would
tokenize differently is rejected like any wrong guess). llguidance calls this
fast-forward and SGLang jump-forward decoding; here it combines with the other
proposers (a request whose grammar forces nothing drafts with the engine's proposer)
and with the P/D handoff (the state is rebuilt from the output, like the runner's).

Drafts come from a shadow state per request, synced to its known output on the
engine thread: the runner's own state belongs to the executor thread. A request with
a step in flight (the zero-bubble loop) does not know its history yet and gets none.
"""

from __future__ import annotations

from typing import Any

from shared.engine.logits.grammars import GrammarCache
from shared.engine.logits.request_state import RequestLogits
from shared.engine.request import Request

__all__ = ["GrammarDrafter"]

MAX_FORCED_DRAFTS = 16  # one verification chunk stays short (the attention kernels' batched path)


class GrammarDrafter:
    def __init__(self, grammars: GrammarCache, tokenizer: Any) -> None:
        self.grammars = grammars
        self.tokenizer = tokenizer
        self._states: dict[str, RequestLogits] = {}

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to `limit` tokens the request's grammar forces next ([] when it forces nothing)."""
        params = request.params
        if params.structured is None or limit <= 0 or request.inflight:
            return []
        state = self._states.get(request.request_id)
        if state is None:
            state = self.grammars.new_state(request.request_id, params, request.prompt_token_ids)
            assert state is not None and state.matcher is not None
            self._states[request.request_id] = state
        state.sync(request.output_token_ids)
        if not state.in_grammar or state.matcher is None or state.matcher.is_terminated():
            return []
        try:
            text = state.matcher.find_jump_forward_string()
        except UnicodeDecodeError:
            # the output stops inside a character (its lead byte came as one token): the forced
            # bytes start mid-character and are no text to tokenize; the mask still forces them
            return []
        if not text:
            return []
        tokens = list(self.tokenizer.encode(text, add_special_tokens=False))[: min(limit, MAX_FORCED_DRAFTS)]
        return tokens[: state.allowed_prefix(tokens)]

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def check_no_leaks(self) -> None:
        assert not self._states, f"grammar drafter kept finished requests: {sorted(self._states)}"
