"""Requests as the engine sees them: sampling parameters, state and outputs.

Lifecycle of a request inside one engine::

    add_request ──► WAITING ──schedule──► RUNNING ──update──► FINISHED_*
                       ▲                     │
                       └──── PREEMPTED ◄─────┘  (blocks ran out: KV dropped,
                                                 recomputed on re-admission)

`num_computed_tokens` counts tokens whose KV is in the cache or being written
by a step already planned: the scheduler advances it when it plans a chunk, as
if every draft in the chunk will be accepted, and `update` takes back what
verification rejected. A step that reaches the end of the tokens samples the
next one.

Tokens in flight: a sampling chunk planned but not yet resolved leaves one
entry in `inflight` (the drafts it verifies). The zero-bubble loop plans
step N+1 before reading step N, so a request may be one or two entries ahead
of its known tokens::

    known:  t_0 .. t_{L-1}                   (all_token_ids, read from finished steps)
    ahead:  t_0 .. t_{L-1} d_0 .. d_{k-1} ?  (num_tokens_ahead = L + k + 1; ? = not sampled yet)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from shared.errors import InvalidRequestError
from shared.multimodal.items import MediaInput
from shared.spec.tree import DraftTree
from shared.structured.spec import GrammarSpec, ReasoningSpec

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_STREAM_INTERVAL = 1024  # tokens one streamed message holds at most (the wire's and the engine's bound)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    # prefill role: first token sampled, KV handed out to a decode engine
    FINISHED_HANDOFF = "finished_handoff"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_HANDOFF: "handoff",
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None = off; n >= 0 = chosen token plus top-n alternatives
    # draft tokens per step for this request: None = the engine's setting, 0 = speculation off
    num_speculative_tokens: int | None = None
    # choices generated from one prompt: one prefill, one handoff, the prompt's blocks shared
    n: int = 1
    # logits processing, applied wherever a token is sampled (see shared/engine/logits/)
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0; tokens in the prompt or output: logit / p if > 0 else logit * p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), each in [-100, 100]
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p times the top token's probability
    structured: GrammarSpec | None = None  # the output (after any thinking) follows this grammar
    reasoning: ReasoningSpec | None = None  # where thinking happens; its token budget
    prompt_logprobs: int | None = None  # None = off; n >= 0 = each prompt token's logprob plus top-n
    # vLLM's per-request stream_interval: new tokens held until this many are out before they stream (the
    # first token and the last always go at once); None = the engine's EngineConfig.stream_interval, and the
    # larger of the two applies (as vLLM)
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if self.seed is not None:
            if not -(2**63) <= self.seed < 2**64:
                raise InvalidRequestError(f"seed must be a 64-bit integer, got {self.seed}", param="seed")
            # one stream per seed on every path: the wire carries uint64, so a negative (OpenAI allows int64)
            # is its two's complement here, before anything seeds a generator with it
            object.__setattr__(self, "seed", self.seed % 2**64)
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", param="temperature"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables), got {self.top_k}", param="top_k")
        if any(t < 0 or t >= 2**32 for t in self.stop_token_ids):  # uint32 on the wire
            raise InvalidRequestError(f"stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}",
                                      param="stop_token_ids")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", param="min_tokens"
            )
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise InvalidRequestError(f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs")
        if self.stream_interval is not None and not (1 <= self.stream_interval <= MAX_STREAM_INTERVAL):
            raise InvalidRequestError(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got "
                                      f"{self.stream_interval}", param="stream_interval")
        if self.num_speculative_tokens is not None and not (0 <= self.num_speculative_tokens <= 16):
            raise InvalidRequestError(
                f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}",
                param="num_speculative_tokens",
            )
        self._check_logits_processing()

    def _check_logits_processing(self) -> None:
        if self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", param=name)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                                      param="repetition_penalty")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias needs token ids >= 0 and values in [-100, 100], got {token_id}: {bias}",
                    param="logit_bias",
                )
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise InvalidRequestError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
                                      param="prompt_logprobs")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalizes(self) -> bool:
        """Whether the output so far changes the logits (presence, frequency, repetition penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether processing a position's logits reads the tokens emitted before it."""
        return self.penalizes or self.structured is not None or self.reasoning is not None

    @property
    def processes_logits(self) -> bool:
        """Whether the logits pipeline (shared/engine/logits/) has anything to do for this request."""
        return bool(self.logit_bias) or self.needs_history


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token plus the top-n alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class InFlight:
    """A planned sampling chunk of a request whose result has not been read yet."""

    drafts: list[int]  # the drafts it verifies
    # proposed ahead: the drafts of the step before that were assumed accepted, and the last token that
    # step was guessed to emit; these drafts follow that history
    assumed_accepted: int = 0
    guess: int | None = None
    # the step before emitted something else: these drafts follow a wrong history and will most likely
    # be rejected, so a proposal made ahead of this step assumes none of them is accepted
    stale: bool = False
    # multi-step decode: the step runs this many decode steps back to back and emits a token from each
    burst: int = 1


# eq=False: a request is itself, not its fields' values. The scheduler asks `request in self.running` for
# each running request every step; the generated __eq__ built and compared tuples of every field, 496 times a
# step at 32 requests (1.5 ms of a 44 ms bf16 step on Sapphire Rapids, cProfile).
@dataclass(eq=False)
class Request:
    """One generation request and its progress. Owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_index: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    # speculation: draft tokens proposed for the next step (set by the engine, consumed by the
    # scheduler); a proposer failure turns speculation off for the rest of the request
    spec_token_ids: list[int] = field(default_factory=list)
    spec_tree: DraftTree | None = None  # the drafts are this tree's nodes 1..n; None: a chain
    spec_disabled: bool = False
    # proposed ahead of a step in flight (zero-bubble loop): what the drafts assume that step emits,
    # its drafts accepted and then its last token
    spec_guess: int | None = None
    spec_assumed_accepted: int = 0
    # one entry per planned sampling chunk whose result has not been read
    inflight: list[InFlight] = field(default_factory=list)
    # prefill role, n > 1 (shared/engine/choices.py): the holder hands its KV off even when its first token
    # ends it (the other choices go on from it); a follower hands off its first token only
    hand_off_always: bool = False
    ships_kv: bool = True
    # params.prompt_logprobs: the logprobs of prompt tokens 1 .. P-1 (what scores token 0?), as computed
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # images and audio in the prompt (shared/multimodal/items.py): soft tokens at their placeholders; the
    # model's images attend to themselves both ways (no chunk may split one)
    media: list[MediaInput] = field(default_factory=list)
    bidirectional_images: bool = False
    # decode role: the name of the kv_transfer agent its KV came through, where a preemption parks its context
    # (shared/engine/kv_spill.py); `num_spill_lookups`: preemptions whose parked context was looked up since,
    # `num_spill_waits`: steps its admission has waited for blocks to read it back into
    kv_home: str = ""
    num_spill_lookups: int = 0
    num_spill_waits: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt must contain at least one token", param="prompt")
        self.all_token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_inflight_tokens(self) -> int:
        """Tokens the planned steps will emit if every draft is accepted (and no stop cuts a burst short)."""
        return sum(len(e.drafts) + e.burst for e in self.inflight)

    @property
    def num_tokens_ahead(self) -> int:
        """Known tokens plus those in flight, as if every draft in flight is accepted."""
        return self.num_tokens + self.num_inflight_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last appended token implies, or None."""
        params = self.params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)


@dataclass
class RequestOutput:
    """What one engine step produced for one request (new tokens since last step)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # prefill role only: the request's KV and hidden states, set when it finishes
    handoff: object | None = None
    index: int = 0  # the choice these tokens belong to (params.n > 1; see shared/engine/choices.py)
    # params.prompt_logprobs, on the request's first output: prompt tokens 1 .. P-1 (token 0 has none)
    prompt_logprobs: list[TokenLogprobs] | None = None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and the next one of the same choice as one (a stream holding tokens back)."""
        return RequestOutput(
            self.request_id, self.new_token_ids + later.new_token_ids, self.new_logprobs + later.new_logprobs,
            later.finished, later.finish_reason, later.num_prompt_tokens, later.num_cached_tokens,
            handoff=later.handoff, index=later.index, prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )
