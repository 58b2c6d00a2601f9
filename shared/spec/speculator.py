"""The engine's side of speculation: who gets drafts, hidden-state history, counters.

One step of an engine with speculation on::

    Speculator.propose(running)      drafts into request.spec_token_ids (decoding requests only)
    scheduler.schedule()             a decoding request with drafts runs [t_{L-1}, d_0 .. d_{k-1}]
    runner.execute()                 verifies: accepted drafts + one recovered/bonus token
    Speculator.observe(plan, result) counts drafts/acceptances; keeps hidden states (EAGLE)
    scheduler.update()               appends, stops, frees the rejected drafts' blocks

How many drafts a request gets: the engine's `num_speculative_tokens`, capped
by the request's own (`SamplingParams.num_speculative_tokens`, 0 = off), by
the tokens it may still emit (a step emits up to k + 1), by the context
length, and by what its drafts have been worth: a running average of the drafts
verification accepted per step, plus one, so a request whose drafts keep failing
verifies one or two instead of paying for k (a batched step on a CPU is
compute-bound: every rejected draft costs a full token of work). A proposer
that raises (or returns ids outside the vocabulary) turns speculation off for
the request it failed on, which goes on decoding plainly; `stats.num_fallbacks`
counts those requests.

Draft trees (`tree`, EAGLE only): a greedy request with room for the whole tree
drafts it instead of a chain (shared/spec/tree.py); sampled requests, those
that name their own number of drafts, and those near their end keep chains. A
tree is not cut by the running average: its breadth is what buys acceptance.

Hidden states (proposers with `uses_hidden_states`): the target's last-layer
hidden state of each computed position, at most `hidden_window` per request,
from prefill chunks (colocated), the prefill engine's handoff (decode role),
and the accepted part of every verification. Row r of what a proposer gets
belongs to position L - 1 - m + r, L being the request's token count.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.request import Request, RequestStatus
from shared.engine.scheduler import SchedulerPlan, StepResult
from shared.errors import ConfigError
from shared.spec.grammar_drafts import MAX_FORCED_DRAFTS, GrammarDrafter
from shared.spec.proposer import ProposalInput, Proposer
from shared.spec.tree import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["SpecStats", "Speculator"]

_AVG_DECAY = 0.5  # weight of the past in a request's running average of accepted drafts


@dataclass
class SpecStats:
    """Counters since the engine started (Prometheus counters read these)."""

    num_verifications: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: accepted drafts at position j
    num_fallbacks: int = 0  # requests whose proposer failed (decoded plainly from then on)
    num_steps_over_batch_limit: int = 0  # steps run without drafts: more requests decoding than disable_batch_size
    num_forced_drafts: int = 0  # drafts a grammar forced (fast-forward), counted in num_draft_tokens too

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts + the bonus/recovered token."""
        if self.num_verifications == 0:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verifications


@dataclass
class _Hidden:
    start_pos: int  # position of rows[0]
    rows: torch.Tensor  # [n, hidden]

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.rows.shape[0]


class Speculator:
    def __init__(
        self,
        proposer: Proposer,
        num_speculative_tokens: int,
        max_model_len: int,
        vocab_size: int,
        hidden_window: int = 64,
        disable_batch_size: int | None = None,
        tree: DraftTree | None = None,
        grammar_drafter: GrammarDrafter | None = None,
        grammar_max_batch: int | None = None,
    ) -> None:
        """`grammar_drafter`: drafts what a request's grammar forces (shared/spec/grammar_drafts.py) before
        the proposer is asked; None = off."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if tree is not None and not getattr(proposer, "drafts_trees", False):
            raise ConfigError(f"{type(proposer).__name__} drafts chains only: a draft tree needs an EAGLE head")
        self.proposer = proposer
        self.grammar_drafter = grammar_drafter
        self.grammar_max_batch = grammar_max_batch  # more requests decoding: no forced drafts this step
        self.tree = tree
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.hidden_window = hidden_window
        # more requests decoding than this: the step runs without drafts (see `propose`)
        self.disable_batch_size = disable_batch_size
        self.uses_hidden_states: bool = getattr(proposer, "uses_hidden_states", False)
        # reads only token ids, so it can propose past a token not read yet (the zero-bubble loop)
        self.proposes_ahead: bool = getattr(proposer, "proposes_ahead", False)
        self.proposes_nothing: bool = getattr(proposer, "proposes_nothing", False)  # grammar drafts only
        depth = max(num_speculative_tokens, tree.max_depth if tree is not None else 0,
                    MAX_FORCED_DRAFTS if grammar_drafter is not None else 0)
        self.stats = SpecStats(accepted_per_position=[0] * depth)
        self._hidden: dict[str, _Hidden] = {}
        self._accepted_avg: dict[str, float] = {}  # per request: running average of drafts accepted per step

    # ---- proposing ------------------------------------------------------------------
    def num_tokens_for(self, request: Request) -> int:
        """How many drafts `request` may verify in its next step."""
        wanted = request.params.num_speculative_tokens
        k = self.num_speculative_tokens if wanted is None else min(wanted, self.num_speculative_tokens)
        # one step emits up to k + 1 tokens and writes KV at positions up to L - 1 + k
        room = min(self._room(request))
        avg = self._accepted_avg.get(request.request_id)
        if avg is not None:  # worth: one more draft than it has been accepting (never below one)
            k = min(k, max(1, math.ceil(avg) + 1))
        return max(0, min(k, room))

    def _room(self, request: Request) -> tuple[int, int]:
        """(tokens it may still emit past the next one, KV positions left past its next token), counting
        what is in flight as if all of it were accepted: a step with n drafts needs n of each for a chain;
        a tree needs its depth of the first and its number of drafts of the second."""
        emit = request.params.max_tokens - request.num_output_tokens - request.num_inflight_tokens - 1
        return emit, self.max_model_len - request.num_tokens_ahead - 1

    def _tree_for(self, request: Request) -> DraftTree | None:
        """The draft tree, for a greedy request with room for all of it (its KV slots and its deepest branch)."""
        tree = self.tree
        # a request that names its number of drafts gets a chain of that many
        if tree is None or not request.params.is_greedy or request.params.num_speculative_tokens is not None:
            return None
        emit_room, kv_room = self._room(request)
        return tree if emit_room >= tree.max_depth and kv_room >= tree.num_drafts else None

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of every running request (drafts for decoding ones, [] otherwise).

        With more requests decoding than `disable_batch_size` no request gets drafts this step (vLLM's
        speculative_disable_by_batch_size): verifying k + 1 rows per request turns a memory-bound decode
        step compute-bound once the batch is large enough, and then drafts cost more than they save
        (EAGLE on two CPU cores: 1.15x plain decoding at batch 1, 0.72x at batch 8). Hidden states are
        still recorded, so drafting resumes as soon as the batch shrinks."""
        decoding = []
        for request in running:
            request.spec_token_ids = []
            request.spec_guess = None
            if request.status == RequestStatus.RUNNING and request.num_tokens_ahead - request.num_computed_tokens == 1:
                decoding.append(request)  # not still prefilling (or resuming after preemption)
        if self.disable_batch_size is not None and len(decoding) > self.disable_batch_size:
            self.stats.num_steps_over_batch_limit += 1
            return
        batch: list[tuple[Request, ProposalInput]] = []
        forced_ok = self.grammar_max_batch is None or len(decoding) <= self.grammar_max_batch
        for request in decoding:
            if (forced_ok and self._grammar_drafts(request)) or self.proposes_nothing:
                continue
            if request.spec_disabled:
                continue
            k = self.num_tokens_for(request)
            if k == 0:
                continue
            if request.inflight:
                if self.proposes_ahead:
                    batch.append((request, ProposalInput(request.request_id, self._plan_ahead(request), k + 1)))
                continue
            hidden = None
            if self.uses_hidden_states:
                hidden = self._hidden_for(request)
                if hidden is None:
                    continue
            tree = self._tree_for(request)
            batch.append((request, ProposalInput(request.request_id, request.all_token_ids,
                                                 k if tree is None else tree.num_drafts, hidden, tree)))
        if not batch:
            return
        for (request, inp), drafts in zip(batch, self._propose_with_fallback(batch), strict=True):
            if request.inflight:  # proposed ahead: the first token stands for the one in flight
                request.spec_guess = drafts[0] if len(drafts) > 1 else None
                drafts = drafts[1:]
            request.spec_token_ids = drafts
            request.spec_tree = inp.tree.prefix(len(drafts)) if inp.tree is not None and drafts else None

    def _grammar_drafts(self, request: Request) -> bool:
        """Draft what the request's grammar forces next; True when it forced something."""
        if self.grammar_drafter is None or request.params.structured is None:
            return False
        if request.params.seed is not None and not request.params.is_greedy:
            # A seeded sampled request keeps the tokens its seed gives on every path: verification draws its
            # noise once a chunk, the sampler once a token, and whether a step fast-forwards depends on the
            # batch at that moment (grammar_max_batch), so on timing (a disaggregated decode sees its
            # requests arrive apart). It decodes token by token.
            return False
        forced = self.grammar_drafter.propose(request, min(self._room(request)))
        if not forced:
            return False
        request.spec_token_ids = forced
        self.stats.num_forced_drafts += len(forced)
        return True

    @staticmethod
    def _plan_ahead(request: Request) -> list[int]:
        """Zero-bubble loop: what to propose from while the request's last step is in flight.

        A proposer that reads nothing but token ids (`proposes_ahead`) guesses past the tokens not
        read yet: from the known tokens plus the drafts in flight taken as accepted (all of them,
        unless they follow a guess already proven wrong), asked for one token more than it needs,
        the first standing for the token in flight. A wrong guess only costs acceptance;
        verification keeps the output exact. Records the assumption on the request for the scheduler.
        """
        (entry,) = request.inflight  # proposing happens with one step in flight at most
        request.spec_assumed_accepted = 0 if entry.stale else len(entry.drafts)
        return request.all_token_ids + entry.drafts[: request.spec_assumed_accepted]

    def _propose_with_fallback(self, batch: list[tuple[Request, ProposalInput]]) -> list[list[int]]:
        try:
            return [self._checked(inp, d) for (_, inp), d in
                    zip(batch, self.proposer.propose([inp for _, inp in batch]), strict=True)]
        except Exception:  # noqa: BLE001 - any proposer failure: find the request(s) it came from
            logger.debug("proposer failed on a batch of %d; retrying one request at a time", len(batch))
        results = []
        for request, inp in batch:
            try:
                results.append(self._checked(inp, self.proposer.propose([inp])[0]))
            except Exception:  # noqa: BLE001 - speculation never fails a request
                logger.warning("request %s: proposer failed, decoding it without speculation",
                               request.request_id, exc_info=True)
                request.spec_disabled = True
                self.stats.num_fallbacks += 1
                self.remove_request(request.request_id)
                results.append([])
        return results

    def _checked(self, inp: ProposalInput, drafts: Sequence[int]) -> list[int]:
        drafts = [int(t) for t in drafts]
        if len(drafts) > inp.num_speculative_tokens:
            raise ValueError(f"proposer returned {len(drafts)} drafts, at most {inp.num_speculative_tokens} asked")
        if any(t < 0 or t >= self.vocab_size for t in drafts):
            raise ValueError(f"proposer returned token ids outside [0, {self.vocab_size}): {drafts}")
        return drafts

    # ---- observing ------------------------------------------------------------------
    def observe(self, plan: SchedulerPlan, result: StepResult) -> None:
        """Count what verification accepted; keep the hidden states of accepted positions."""
        for chunk in plan.chunks:
            num_valid = chunk.num_tokens
            emitted = result.emitted.get(chunk.request_id)
            if chunk.num_draft_tokens and emitted is not None:
                num_accepted = len(emitted) - 1
                s = self.stats
                s.num_verifications += 1
                s.num_draft_tokens += chunk.num_draft_tokens
                s.num_accepted_tokens += num_accepted
                for j in range(num_accepted):
                    s.accepted_per_position[j] += 1
                avg = self._accepted_avg.get(chunk.request_id, float(num_accepted))
                self._accepted_avg[chunk.request_id] = _AVG_DECAY * avg + (1 - _AVG_DECAY) * num_accepted
                num_valid = chunk.num_tokens - chunk.num_draft_tokens + num_accepted
            hidden = result.spec_hidden_states.get(chunk.request_id)
            if hidden is not None:
                self.add_hidden_states(chunk.request_id, hidden[:num_valid], chunk.start_pos)

    def add_hidden_states(self, request_id: str, rows: torch.Tensor, start_pos: int) -> None:
        """Record the target's hidden states of positions start_pos .. start_pos + len(rows) - 1."""
        if not self.uses_hidden_states or rows.shape[0] == 0:
            return
        old = self._hidden.get(request_id)
        if old is not None and old.start_pos <= start_pos <= old.end_pos:
            # contiguous (or a recompute of a suffix): keep what precedes start_pos. A handoff's rows live on
            # the host, a verification's on the engine's device: the newest rows say where they all go
            rows = torch.cat([old.rows[: start_pos - old.start_pos].to(rows.device), rows])
            start_pos = old.start_pos
        keep = min(rows.shape[0], self.hidden_window)
        self._hidden[request_id] = _Hidden(start_pos + rows.shape[0] - keep, rows[-keep:])

    def _hidden_for(self, request: Request) -> torch.Tensor | None:
        """Rows for positions up to L - 2 (the newest token has not run yet), or None if missing."""
        h = self._hidden.get(request.request_id)
        if h is None or h.end_pos != request.num_tokens - 1:
            return None
        return h.rows

    # ---- lifecycle --------------------------------------------------------------------
    def remove_request(self, request_id: str) -> None:
        if self.grammar_drafter is not None:
            self.grammar_drafter.remove_request(request_id)
        self._hidden.pop(request_id, None)
        self._accepted_avg.pop(request_id, None)
        remove = getattr(self.proposer, "remove_request", None)
        if remove is not None:
            remove(request_id)

    def check_no_leaks(self) -> None:
        assert not self._hidden, f"hidden states kept for finished requests: {sorted(self._hidden)}"
        assert not self._accepted_avg, f"acceptance kept for finished requests: {sorted(self._accepted_avg)}"
        check = getattr(self.proposer, "check_no_leaks", None)
        if check is not None:
            check()
        if self.grammar_drafter is not None:
            self.grammar_drafter.check_no_leaks()
