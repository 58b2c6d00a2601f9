"""The scheduler: a pure step over dataclasses, no model and no device.

    plan = scheduler.schedule()          # which tokens of which requests run now
    result = runner.execute(plan)        # (not here) the forward pass + sampling
    outputs = scheduler.update(plan, result)

Each step spends a token budget: running requests first (one token each while
decoding, a chunk while still prefilling), then waiting requests in arrival
order, whose prompt is split into chunks when the budget runs short (chunked
prefill). Blocks for the step are reserved before the step runs; when the pool
is dry the most recently admitted running request is preempted: its blocks go
back to the pool and it re-enters the waiting queue to be recomputed.

Prefixes shared within a batch are computed once: a waiting request whose
first uncached full block is one that a planned step is filling (a request
admitted earlier in this plan, or a step still in flight, has the same tokens
there) is passed over for now, and later requests go ahead of it. Once that
step is read the block is a prefix-cache hit, so requests that arrive together
with a common system prompt prefill it once, not once each (SGLang defers such
requests the same way). `share_planned_prefixes=False` turns it off.

Planning is optimistic: `schedule()` advances each request's
`num_computed_tokens` past its chunk at once, as if every draft will be
accepted, and a sampling chunk leaves an entry in `request.inflight`;
`update()` reads the result, takes back what verification rejected and
appends the emitted tokens. The synchronous loop calls update before the next
schedule. The zero-bubble loop plans step N+1 before step N's result is read:
a request that samples in N then runs `[?, drafts...]` in N+1, `?` being a
placeholder for the token N emits (the runner takes it from N's outputs on the
device, and corrects the positions by the drafts N rejected). A request certain
to finish with N's tokens (max_tokens, context length) is not planned again.

Speculation (decode and colocated roles): before `schedule()` the engine
puts a request's draft tokens in `request.spec_token_ids`. A decoding request
with drafts runs as one chunk `[last token, d_0 .. d_{k-1}]` that verifies them
(`ScheduledChunk.num_draft_tokens = k`); blocks are reserved for all k + 1
positions, or the drafts are dropped when that would not fit (guesses never
preempt anyone). `update()` appends the accepted drafts plus the recovered or
bonus token, checks stop conditions after each, and gives back the blocks that
only rejected drafts needed::

    before:  computed t_0 .. t_{L-2} | run t_{L-1} d_0 d_1 d_2     (L + 3 slots held)
    after 1 accepted:  t_0 .. t_{L-1} d_0 | r   computed = L + 1, slots held for L + 2

A draft tree (`request.spec_tree`, shared/spec/tree.py) is planned the same
way with its n nodes as the drafts: n + 1 slots reserved, and "every draft
accepted" is the upper bound the accounting assumes. The runner moves the
accepted branch's KV to the slots a chain would have used, so `update()` treats
the emitted tokens exactly as a chain's.

Roles: in the `prefill` role a request finishes as soon as its first token is
sampled (FINISHED_HANDOFF) and keeps its blocks until the engine has handed its
KV out and calls `release_handoff`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.engine.block_pool import BlockHash
from shared.engine.kv_manager import KVCacheManager
from shared.engine.request import (
    InFlight,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    TokenLogprobs,
)
from shared.multimodal.items import MediaInput, fit_chunk_end
from shared.spec.tree import DraftTree

logger = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")
PLACEHOLDER_TOKEN_ID = 0  # stands in for the token the previous step emits, before it is read


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    role: str = "colocated"
    spec_needs_hidden: bool = False  # the proposer reads the target's hidden states (EAGLE)
    # A waiting request whose next uncached block a planned step is filling waits for it (see module doc)
    share_planned_prefixes: bool = True
    # multi-step decode: a step where every request decodes greedily with nothing reading its logits runs up
    # to this many decode steps back to back (vLLM's --num-scheduler-steps); see `_plan_burst`
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")


@dataclass
class ScheduledChunk:
    """Tokens of one request that run in this step."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # the request's block table, covering start_pos + len(token_ids)
    sample: bool  # the chunk reaches the last known token: sample the next one
    params: SamplingParams
    suppress_token_ids: frozenset[int] = frozenset()  # masked while below min_tokens
    return_hidden: bool = False  # prefill role: keep last-layer hidden states
    # speculation: the last num_draft_tokens of token_ids are drafts to verify
    num_draft_tokens: int = 0
    draft_tree: DraftTree | None = None  # the drafts are this tree's nodes 1..n (never a continuing chunk)
    # suppress_token_ids applies to this many sampling positions, counted from the first (<= 0: none);
    # for a chunk that continues the previous step, plus the drafts that step rejects
    num_suppressed_positions: int = 0
    return_spec_hidden: bool = False  # the proposer wants this chunk's last-layer hidden states
    # params.prompt_logprobs: the prompt tokens this chunk's rows predict (row i scores token start_pos + i + 1)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # zero-bubble loop: token_ids[0] is a placeholder for what the previous step emits last, and
    # start_pos assumes every draft of that step is accepted (the runner corrects both on the device)
    continues: bool = False
    epoch: int = 0  # the request's preemption count when planned: a result from an older epoch is stale
    group_block_ids: list[list[int]] = field(default_factory=list)  # its tables in the other layer groups
    # multi-step decode: the chunk's one token starts `burst` decode steps run back to back, each fed the
    # token the one before sampled (greedy); KV slots are reserved for all of them and a token comes from each
    burst: int = 1
    # logits processing that reads the output so far (penalties, grammars): the request's output list
    # (appended to, never rewritten) and how much of it was known when planned. The history before this
    # chunk's first sampled position is its first num_known_outputs tokens, plus (continuing chunks) what
    # the previous step emits. Empty when the request's params do not need it.
    output_token_ids: list[int] = field(default_factory=list)
    num_known_outputs: int = 0
    # multimodal prompts: the items whose soft tokens this chunk covers (shared/multimodal/items.py), and whether
    # an image's tokens attend to each other (the scheduler then never splits an image across chunks)
    media: list[MediaInput] = field(default_factory=list)
    bidirectional_images: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class StepResult:
    """What the runner produced for a plan: one entry per sampling chunk."""

    # sampled token, or (verification chunks) the accepted drafts then the recovered or bonus token
    emitted: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # parallel to emitted, when asked
    # prefill role: last-layer hidden states of the chunk's tokens, [num_tokens, hidden]
    hidden_states: dict[str, Any] = field(default_factory=dict)
    # chunks with return_spec_hidden: [num_tokens, hidden], drafts included
    spec_hidden_states: dict[str, Any] = field(default_factory=dict)
    # chunks with prompt_logprob_targets: one entry per target
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.handoff_pending: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.num_scheduled_tokens_total = 0  # tokens planned for computing (drafts included), over all steps
        self.num_bursts_total = 0  # plans that ran several decode steps back to back (num_scheduler_steps)
        # a second tier for preempted contexts (kv_spill.py): told of a preempted request before its blocks are
        # freed, and of a resuming one before its admission looks up the prefix cache (True: admit it later)
        self.on_preempt: Callable[[Request], None] | None = None
        self.on_resume: Callable[[Request], bool] | None = None

    # ---- intake -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Adopt a request whose KV is already in its allocated blocks (decode role)."""
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.kv.cache_full_blocks(request)
        self.running.append(request)

    def abort(self, request_id: str) -> bool:
        """Abort at any point; frees the request's blocks once. False if unknown/finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.handoff_pending.pop(request_id, None)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return True

    def release_handoff(self, request_id: str) -> None:
        """Prefill role: the KV has been handed out; give the blocks back."""
        request = self.handoff_pending.pop(request_id)
        del self.requests[request_id]
        self.kv.free(request)

    # ---- the step -----------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        plan = SchedulerPlan()
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        burst = self._plan_burst()
        for request in list(self.running):
            if budget <= 0:  # an image kept whole may take a chunk past the budget
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            if self._finishes_in_flight(request):
                request.spec_token_ids = []
                request.spec_tree = None
                continue
            num_new = _fit_media(request, request.num_computed_tokens,
                                 min(request.num_tokens_ahead - request.num_computed_tokens, budget))
            tree = request.spec_tree
            drafts = self._fit_drafts(request, num_new, budget)
            if not self._reserve(request, num_new + burst - 1, plan, scheduled):
                continue
            tree = tree.prefix(len(drafts)) if tree is not None and drafts else None
            plan.chunks.append(self._chunk(request, num_new, drafts, tree if tree and not tree.is_chain else None,
                                           burst))
            scheduled.append(request)
            budget -= num_new + len(drafts)
        if not plan.preempted_ids and burst == 1:
            self._admit_waiting(plan, budget)
        self.num_scheduled_tokens_total += plan.num_tokens
        if burst > 1:
            self.num_bursts_total += 1
        return plan

    def _plan_burst(self) -> int:
        """Decode steps this plan runs back to back: num_scheduler_steps when nobody waits and every running
        request decodes one token greedily with nothing reading its logits (no logprobs, penalties, grammar,
        bias, min_tokens, drafts) and has that many tokens left before max_tokens and max_model_len; else 1.

        A burst reads nothing on the host between its steps, which is what makes it pay where the host's work
        per step outlasts the GPU's (a small model on a GPU). A stop inside a burst drops the tokens after it.
        """
        steps = self.config.num_scheduler_steps
        if steps == 1 or self.waiting or not self.running:
            return 1
        for request in self.running:
            params = request.params
            if (not params.is_greedy or params.logprobs is not None or params.processes_logits
                    or params.min_tokens > request.num_output_tokens or request.spec_token_ids
                    or request.media and request.num_computed_tokens < request.num_prompt_tokens
                    or request.num_tokens_ahead - request.num_computed_tokens != 1
                    or self.kv.group_block_ids(request.request_id)):  # layer groups: the runner bursts one table
                return 1
            left = min(params.max_tokens - request.num_output_tokens,
                       self.config.max_model_len - request.num_tokens) - request.num_inflight_tokens
            steps = min(steps, left)
            if steps <= 1:
                return 1
        # reserving a burst's slots never preempts: short of blocks, the plan decodes one step
        need = sum(self.kv.blocks_needed(r, r.num_computed_tokens + steps) for r in self.running)
        return steps if need <= self.kv.num_free_blocks else 1

    def _finishes_in_flight(self, request: Request) -> bool:
        """The tokens already in flight are certain to end the request (each entry emits at least one)."""
        num_certain = len(request.inflight)
        return num_certain > 0 and (
            request.num_output_tokens + num_certain >= request.params.max_tokens
            or request.num_tokens + num_certain >= self.config.max_model_len
        )

    def _fit_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts that fit the budget and the free blocks; [] unless it is decoding."""
        drafts = request.spec_token_ids[: budget - num_new]  # a tree's first nodes are a tree: cut anywhere
        request.spec_token_ids = []
        request.spec_tree = None
        if not drafts or request.num_tokens_ahead - request.num_computed_tokens != 1:
            return []
        if not self.kv.allocate_slots(request, request.num_computed_tokens + num_new + len(drafts)):
            return []  # no room to speculate: decode plainly rather than preempt anyone for a guess
        return drafts

    def _reserve(
        self, request: Request, num_new: int, plan: SchedulerPlan, scheduled: list[Request]
    ) -> bool:
        """Reserve blocks for `num_new` tokens, preempting from the back as needed."""
        while not self.kv.allocate_slots(request, request.num_computed_tokens + num_new):
            victim = self.running[-1]
            if victim in scheduled:  # never preempt work already in this plan
                victim = request
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, plan: SchedulerPlan, budget: int) -> None:
        # hashes of full blocks that planned steps are filling (None until a waiting request needs them)
        planned: set[BlockHash] | None = None
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            if request.status == RequestStatus.PREEMPTED and self.on_resume is not None and self.on_resume(request):
                break  # its parked context comes back once blocks are free to read it into: a step later
            cached, next_hash = self.kv.lookup_prefix(request) if request.num_computed_tokens == 0 else ([], None)
            if next_hash is not None and self.config.share_planned_prefixes:
                if planned is None:
                    planned = {h for r in self.running for h in self.kv.planned_block_hashes(r)}
                if next_hash in planned:  # a step in flight or in this plan computes its next block
                    i += 1
                    continue
            num_computed = request.num_computed_tokens + len(cached) * self.kv.block_size
            num_new = _fit_media(request, num_computed, min(request.num_tokens - num_computed, budget))
            if not self.kv.allocate_slots(request, num_computed + num_new, cached):
                break
            del self.waiting[i]
            if request.status == RequestStatus.WAITING:  # first admission, not a resume
                request.num_cached_tokens = len(cached) * self.kv.block_size
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
            if planned is not None:
                planned.update(self.kv.planned_block_hashes(request))

    def _preempt(self, request: Request, plan: SchedulerPlan) -> None:
        logger.info("preempting request %s (%d tokens) to free KV blocks", request.request_id,
                    request.num_tokens)
        self.running.remove(request)
        if self.on_preempt is not None:
            self.on_preempt(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.spec_tree = None
        request.inflight = []  # what those steps emit is dropped: recomputed on resume
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        plan.preempted_ids.append(request.request_id)

    def _chunk(self, request: Request, num_new: int, drafts: list[int] | None = None,
               tree: DraftTree | None = None, burst: int = 1) -> ScheduledChunk:
        """Plan `num_new` tokens (then `drafts`, the nodes of `tree` when given; or a burst of decode steps)
        of `request` and advance it past them."""
        drafts = drafts or []
        start = request.num_computed_tokens
        end = start + num_new
        continues = start >= request.num_tokens  # its one token is the previous step's, not read yet
        assert not continues or num_new == 1, (request.request_id, start, num_new)
        # a tree's positions follow its depths, which the device-side correction of a continuing chunk
        # does not know: trees come from proposers that wait for each step's tokens (EAGLE)
        assert tree is None or (not continues and tree.num_drafts == len(drafts)), (request.request_id, tree)
        params = request.params
        suppress: frozenset[int] = frozenset()
        # positions below min_tokens, as if every draft in flight is accepted (the runner corrects it)
        num_below_min = params.min_tokens - request.num_output_tokens - request.num_inflight_tokens
        if params.min_tokens > request.num_output_tokens:
            suppress = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else request.eos_token_ids
            )
        sample = end == request.num_tokens_ahead
        chunk = ScheduledChunk(
            request_id=request.request_id,
            token_ids=([PLACEHOLDER_TOKEN_ID] if continues else request.all_token_ids[start:end]) + drafts,
            start_pos=start,
            block_ids=list(self.kv.block_ids(request.request_id)),
            group_block_ids=[list(t) for t in self.kv.group_block_ids(request.request_id)],
            sample=sample,
            params=params,
            suppress_token_ids=suppress,
            return_hidden=self.config.role == "prefill" and start < request.num_prompt_tokens,
            num_draft_tokens=len(drafts),
            draft_tree=tree,
            num_suppressed_positions=num_below_min,
            return_spec_hidden=self.config.spec_needs_hidden,
            continues=continues,
            epoch=request.num_preemptions,
            prompt_logprob_targets=request.prompt_token_ids[start + 1 : min(end + 1, request.num_prompt_tokens)]
            if params.prompt_logprobs is not None else [],
            output_token_ids=request.output_token_ids if params.needs_history else [],
            num_known_outputs=request.num_output_tokens,
            media=[m for m in request.media if m.item.offset < end and m.item.end > start],
            bidirectional_images=request.bidirectional_images,
            burst=burst,
        )
        request.num_computed_tokens = end + len(drafts) + burst - 1
        if sample:
            ahead = continues and bool(drafts) and request.spec_guess is not None
            request.inflight.append(InFlight(drafts, request.spec_assumed_accepted if ahead else 0,
                                             request.spec_guess if ahead else None, burst=burst))
        request.spec_guess = None
        return chunk

    def update(self, plan: SchedulerPlan, result: StepResult) -> list[RequestOutput]:
        """Resolve a plan: read what it emitted, take back rejected drafts, check stops, free blocks."""
        outputs: list[RequestOutput] = []
        for chunk in plan.chunks:
            if not self.is_current(chunk):
                continue  # aborted, finished or preempted since it was planned: its work is dropped
            request = self.requests[chunk.request_id]
            prompt_logprobs = result.prompt_logprobs.get(chunk.request_id)
            # in position order, once (a preempted request computes its prompt again)
            if prompt_logprobs and chunk.start_pos == len(request.prompt_logprobs):
                request.prompt_logprobs.extend(prompt_logprobs)
            if chunk.sample:
                outputs.append(self._update_sampled(request, chunk, result))
            else:
                self.kv.cache_full_blocks(request)
        return outputs

    def is_current(self, chunk: ScheduledChunk) -> bool:
        """The chunk's request still runs as it did when the chunk was planned (its result counts)."""
        request = self.requests.get(chunk.request_id)
        return request is not None and request.status == RequestStatus.RUNNING and request.num_preemptions == chunk.epoch

    def _update_sampled(self, request: Request, chunk: ScheduledChunk, result: StepResult) -> RequestOutput:
        """Append the emitted tokens in order up to the first stop; drop what rejected drafts held."""
        entry = request.inflight.pop(0)
        drafts = entry.drafts
        assert len(drafts) == chunk.num_draft_tokens, (request.request_id, drafts, chunk.num_draft_tokens)
        token_ids = result.emitted[chunk.request_id]
        logprobs = result.logprobs.get(chunk.request_id, [])
        # planned as if all drafts were accepted: the rejected ones' positions are not computed after all
        # (a burst emits a token from each of its steps)
        num_rejected = len(drafts) + entry.burst - len(token_ids)
        request.num_computed_tokens -= num_rejected
        if request.inflight and request.inflight[0].guess is not None:  # proposed ahead of this step
            later = request.inflight[0]
            later.stale = later.assumed_accepted != len(token_ids) - 1 or later.guess != token_ids[-1]
        status = None
        num_emitted = 0
        for i, token_id in enumerate(token_ids):
            request.append_output(token_id, logprobs[i] if logprobs else None)
            num_emitted += 1
            status = self._stop_status(request)
            if status is not None:
                break
        self.kv.cache_full_blocks(request)
        if status is not None:
            self._finish(request, status)
        else:  # slots of rejected drafts are garbage; a step planned since keeps what it writes
            self.kv.truncate(request, max(request.num_tokens, request.num_computed_tokens))
        return self._output(request, token_ids[:num_emitted], logprobs[:num_emitted])

    def _stop_status(self, request: Request) -> RequestStatus | None:
        status = request.check_stop()
        if status is None and request.num_tokens >= self.config.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if self.config.role == "prefill" and (status is None or request.hand_off_always):
            status = RequestStatus.FINISHED_HANDOFF
        return status

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.running.remove(request)
        if status == RequestStatus.FINISHED_HANDOFF:
            self.handoff_pending[request.request_id] = request
            return
        del self.requests[request.request_id]
        self.kv.free(request)

    @staticmethod
    def _output(request: Request, token_ids: list[int], logprobs: list[TokenLogprobs]) -> RequestOutput:
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True
            prompt_logprobs = request.prompt_logprobs
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_logprobs=logprobs,
            finished=request.status.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    # ---- introspection ------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)


def _fit_media(request: Request, start: int, num_new: int) -> int:
    """`num_new` moved so that the chunk from `start` splits no image whose tokens attend to each other."""
    if not request.bidirectional_images or start >= request.num_prompt_tokens:
        return num_new
    return fit_chunk_end(request.media, start, start + num_new) - start
