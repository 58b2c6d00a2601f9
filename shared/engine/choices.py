"""Requests with n > 1 choices: the prompt computed once, n sequences after it.

    add(request, n) ──► choice 0, the holder: computes the prompt (colocated, prefill) or pulls
                        its KV from kv_transfer (decode)
                   └──► choices 1..n-1, followers: held back until the holder is in the scheduler,
                        so that its prompt blocks are planned or cached when they are admitted; they
                        then compute only what the prefix cache lacks (the prompt's last, partial
                        block) and sample on their own

A follower shares the holder's full prompt blocks through the block pool's reference
counts; the last partial block, which each choice writes its own tokens into, is
recomputed per follower (fewer than block_size tokens) rather than copied: vLLM v1
shares n > 1 the same way, and a recomputed block needs no copy ordered against the
steps in flight. Over the split path, one prefill computes the prompt and ships one
handoff: the followers on the prefill engine sample their first tokens and ship
nothing, and on the decode engine they start from the holder's pulled blocks.

Choice i is its own engine request, `choice_request_id(request_id, i)`, with the
request's parameters, n = 1, and seed + i (choice 0 of a seeded request repeats an
n = 1 request with the same seed). Outputs leave the engine under the request's id
with their choice's index; aborting the request's id aborts every choice, a choice's
own id that choice alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shared.engine.request import Request, RequestOutput, SamplingParams, TokenLogprobs

__all__ = ["ChoiceGroups", "FirstToken", "child_params", "choice_request_id", "split_choice_id"]

_SEP = "#"
_SEED_MOD = 2**64


def choice_request_id(request_id: str, index: int) -> str:
    return f"{request_id}{_SEP}{index}"


def split_choice_id(engine_id: str) -> tuple[str, int] | None:
    """(request id, index) of a choice's id; None for a request's own id (ids the router makes hold no '#')."""
    request_id, sep, index = engine_id.rpartition(_SEP)
    return (request_id, int(index)) if sep and index.isdigit() else None


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: n = 1 and its own seed stream."""
    seed = None if params.seed is None else (params.seed + index) % _SEED_MOD
    return replace(params, n=1, seed=seed)


@dataclass(frozen=True)
class FirstToken:
    """What prefill sampled for one choice."""

    token_id: int
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # set: this token already ended the choice


@dataclass
class _Group:
    request_id: str
    child_ids: list[str]
    live: set[str]  # children not finished yet
    holder_id: str | None = None  # while followers wait for it
    followers: list[Request] = field(default_factory=list)


class ChoiceGroups:
    """The engine's n > 1 requests: which child belongs to which request, and followers held back."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._parent: dict[str, tuple[str, int]] = {}  # child id -> (request id, index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add(self, request_id: str, n: int) -> list[str]:
        """Register a request of n choices; their engine ids, in order."""
        ids = [choice_request_id(request_id, i) for i in range(n)]
        self._groups[request_id] = _Group(request_id, ids, set(ids))
        for i, child_id in enumerate(ids):
            self._parent[child_id] = (request_id, i)
        return ids

    def parent_of(self, child_id: str) -> tuple[str, int] | None:
        """(request id, index) of a choice's engine id; None for any other id."""
        return self._parent.get(child_id)

    def hold(self, request_id: str, holder_id: str, followers: list[Request]) -> None:
        """Keep `followers` back until `holder_id` is in the scheduler (or gone)."""
        group = self._groups[request_id]
        group.holder_id = holder_id
        group.followers = followers

    def release(self, holder_pending: Callable[[str], bool]) -> list[Request]:
        """Followers whose holder no longer waits to enter the scheduler (admitted, finished or failed)."""
        out: list[Request] = []
        for group in self._groups.values():
            if group.followers and group.holder_id is not None and not holder_pending(group.holder_id):
                out.extend(group.followers)
                group.followers = []
                group.holder_id = None
        return out

    @property
    def num_held(self) -> int:
        return sum(len(g.followers) for g in self._groups.values())

    def to_request_output(self, out: RequestOutput) -> RequestOutput:
        """An output of a child, under its request's id and its index; forgets the child once finished."""
        entry = self._parent.get(out.request_id)
        if entry is None:
            return out
        request_id, index = entry
        if out.finished:
            self._forget(out.request_id)
        return replace(out, request_id=request_id, index=index)

    def abort(self, request_id: str) -> tuple[list[str], bool]:
        """(children of `request_id` to abort in the engine, whether held followers were dropped)."""
        group = self._groups.get(request_id)
        if group is None:
            if request_id in self._parent:  # one choice alone
                held = any(r.request_id == request_id for r in self._groups[self._parent[request_id][0]].followers)
                self._forget(request_id)
                return [request_id], held
            return [], False
        dropped = bool(group.followers)
        for child_id in list(group.live):
            self._forget(child_id)
        return list(group.child_ids), dropped

    def _forget(self, child_id: str) -> None:
        request_id, _ = self._parent.pop(child_id)
        group = self._groups[request_id]
        group.live.discard(child_id)
        group.followers = [r for r in group.followers if r.request_id != child_id]
        if not group.live:
            del self._groups[request_id]

    def failed_request_id(self, child_id: str) -> tuple[str, int]:
        """(request id, index) a failure of engine request `child_id` is reported under."""
        request_id, index = self._parent.get(child_id, (child_id, 0))
        if child_id in self._parent:
            self._forget(child_id)
        return request_id, index

    def check_no_leaks(self) -> None:
        assert not self._groups and not self._parent, f"choice groups left: {sorted(self._groups)}"
