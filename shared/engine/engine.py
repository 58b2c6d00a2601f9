"""The engine: scheduler + runner + block pool behind a small request API.

    add_request / add_handoff ─► step() ─► [RequestOutput] ... ─► finished
                                  │
                                  ├ schedule()      (pure, host)
                                  ├ runner.execute  (forward + sample)
                                  └ update()        (append, stop, free)

Two loops drive those three. The synchronous one runs them in order. The
zero-bubble one (`async_scheduling`, colocated and decode roles) keeps the
executor busy: a step plans N+1 while N runs on the executor thread, hands
N+1 over the moment N ends (N+1's inputs take N's tokens and accepted counts
from N's outputs on the device), and only then reads N's results::

    engine thread:  plan N+1 ─ wait N ─ submit N+1 ─ read N, stream, stop checks ─ plan N+2 ─ wait N+1 ...
    executor:       ════ N ════════════╪═════════════ N+1 ═════════════════════════════╪═══ N+2 ...

Results arrive one step late: a request that finished in N has already run in
N+1, whose tokens for it are dropped. Blocks freed while a step runs may go to
the steps planned after it, but not to a KV handoff written from the host until
it ends (`BlockPool.hold_frees`): it may still write them.

Roles: `colocated` runs requests start to end. `prefill` stops each request
after its first token and returns its `KVHandoff` on the final output.
`decode` admits requests with `add_handoff`, copying their KV into blocks it
reserves, and continues from the first token.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from shared.engine.choices import ChoiceGroups, FirstToken, child_params, choice_request_id
from shared.engine.config import EngineConfig
from shared.engine.handoff import KVHandoff, check_handoff_kv, extract_kv, inject_kv
from shared.engine.kv_offload import group_tiers
from shared.engine.kv_setup import build_kv_cache
from shared.engine.kv_spill import KVSpill, KVTransferCalls
from shared.engine.logits.grammars import GrammarCache
from shared.engine.logits.request_state import RequestLogits
from shared.engine.remote_kv import RemoteKV
from shared.engine.request import Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprobs
from shared.engine.runner import ModelRunner, StepInputs, StepOutput
from shared.engine.scheduler import Scheduler, SchedulerConfig, SchedulerPlan, StepResult
from shared.errors import BatonError, ConfigError, ContextLengthExceededError, InvalidRequestError
from shared.kv.layout import kv_groups
from shared.kv.remote import AgentAddress, ClaimedHandoff, HandoffSlots
from shared.models.common import LayerDoneFn
from shared.models.loader import LoadedModel, load_model
from shared.multimodal.items import AUDIO, IMAGE, VIDEO, MediaInput, MediaItem, check_placement
from shared.ops.attention import paged_attention_ref
from shared.spec.factory import build_speculator
from shared.spec.speculator import Speculator

logger = logging.getLogger(__name__)

_TRANSFER_POLL_S = 0.0005
_LONG_STEP_TOKENS = 64  # steps of this many tokens or more call `between_layers` (tens of ms a layer on a CPU)
# how long a step waits for a computed prompt's last KV writes (a few ms on one host) before it runs anyway
_PUSH_SETTLE_S = 0.02


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    handoff: KVHandoff | None = None


def pick_attention(backend: str, device: str):  # type: ignore[no-untyped-def]
    """On the CPU the C++ decode kernel over the torch reference (which it falls back to); the Triton
    kernel on CUDA; "torch" = the reference everywhere."""
    if backend == "torch":
        return paged_attention_ref
    if backend == "auto" and not device.startswith("cuda"):
        from shared.ops.cpu_attention import paged_attention_cpu

        return paged_attention_cpu
    from shared.ops.triton_attention import paged_attention_triton

    return paged_attention_triton


@dataclass
class _InFlight:
    """The step the executor is running (zero-bubble loop)."""

    inputs: StepInputs
    future: Future[StepOutput]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        attention = pick_attention(config.attention_backend, config.device)
        self.precision = config.precision
        logger.info("precision (--dtype %s, --kv-cache-dtype %s, --quantization %s): %s", config.dtype,
                    config.kv_cache_dtype, config.quantization, self.precision.describe())
        self.loaded = loaded or load_model(
            config.model, attention, config.device, self.precision.compute, config.cache_dir, config.max_model_len,
            decodes=config.role != "prefill", weight_format=config.weight_format, encoder_graphs=config.cuda_graphs,
        )
        if self.loaded.model.weight_format != config.weight_format:
            raise ConfigError(f"the model given holds {self.loaded.model.weight_format.describe()} weights; "
                              f"--dtype {config.dtype} --quantization {config.quantization} asks for "
                              f"{config.weight_format.describe()}")
        spec = self.loaded.spec
        self.max_model_len = min(spec.max_positions, config.max_model_len or spec.max_positions)
        # decode batches replay CUDA graphs whose padding rows write into one more block, which the
        # pool never hands out; layer groups (Gemma 4) replay none
        use_graphs = config.cuda_graphs and config.device.startswith("cuda") and config.role != "prefill" \
            and (len(kv_groups(spec.kv_layers)) == 1 or not config.kv_layer_groups)
        # prefix hashes name the model and its precision too: blocks of two models, or of one model's bf16 and
        # fp32 caches, never match, in this process or in kv_transfer's shared pool
        salt = f"{self.loaded.identity}:{self.precision.kv_cache}:{self.loaded.model.weight_format.describe()}"
        self.layout, self.pool, self.kv = build_kv_cache(config, spec.kv_layers, salt, self.max_model_len,
                                                         int(use_graphs))
        num_blocks = self.pool.num_blocks
        self.grammars = GrammarCache(self.loaded.tokenizer, spec.vocab_size, self.loaded.eos_token_ids)
        self.speculator: Speculator | None = build_speculator(config, self.loaded, self.max_model_len, num_blocks,
                                                              self.grammars)
        sched_config = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, config.role,
            spec_needs_hidden=self.speculator is not None and self.speculator.uses_hidden_states,
            # a proposer reads every step's tokens, and a prefill engine's requests end at their first token
            # (grammar fast-forward drafts only for structured requests, which never burst)
            num_scheduler_steps=(config.num_scheduler_steps if config.spec_method == "none"
                                 and config.role != "prefill" else 1),
        )
        self.scheduler = Scheduler(sched_config, self.kv)
        if any(not 0 <= layer < spec.num_layers for layer in config.aux_hidden_layers):
            raise ConfigError(f"aux_hidden_layers {config.aux_hidden_layers} outside [0, {spec.num_layers})")
        self.runner = ModelRunner(self.loaded.model, self.layout, config.device, config.seed,
                                  tuple(config.aux_hidden_layers))
        self.runner.media_encoder = self.loaded.media_encoder
        self.runner.bidirectional_every_layer = bool(self.loaded.multimodal is not None
                                                     and self.loaded.multimodal.bidirectional_every_layer)
        self._attach_offload_tier()
        bind = getattr(self.speculator.proposer, "bind_target", None) if self.speculator is not None else None
        if bind is not None:  # a proposer that reads the target's cache (gemma4_assistant)
            bind(self.runner.model_kv, self.kv, self.layout)
        if use_graphs:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len, scratch_block=num_blocks)
        self.choices = ChoiceGroups()  # requests with n > 1 (shared/engine/choices.py)
        self._pending_handoffs: deque[tuple[Request, KVHandoff]] = deque()
        self.remote: RemoteKV | None = None  # handoffs through kv_transfer, when a service enables them
        self.spill: KVSpill | None = None  # preempted contexts parked in kv_transfer (enable_kv_spill)
        self._hidden: dict[str, list[torch.Tensor]] = {}
        self._arrivals = 0
        self.async_scheduling = self._use_async_scheduling()
        # called between the layers of a step of _LONG_STEP_TOKENS or more (the core share's fit_threads); a
        # layer hook takes decode steps off their fast paths (the CPU layer loop, CUDA graphs), so short ones
        # go without
        self.between_layers: Callable[[], None] | None = None
        # called before and after each step on the thread that runs its kernels (the core share's fit_threads
        # and step_over): torch keeps a thread count per thread, and the zero-bubble loop runs its steps on the
        # executor thread
        self.before_step: Callable[[], None] | None = None
        self.after_step: Callable[[], None] | None = None
        self._executor: ThreadPoolExecutor | None = None  # the zero-bubble loop's, started on first use
        self._in_flight: _InFlight | None = None
        logger.info("engine ready: role=%s, %d KV blocks x %d tokens (%.1f MiB), max_model_len=%d, %s loop",
                    config.role, num_blocks, config.block_size, self.layout.total_nbytes / 2**20,
                    self.max_model_len, "zero-bubble" if self.async_scheduling else "synchronous")

    def _use_async_scheduling(self) -> bool:
        wanted = self.config.async_scheduling
        if wanted is None:
            wanted = self.config.device.startswith("cuda")
        if not wanted:
            return False
        if self.config.role == "prefill":
            # a prefill request ends at its first token and its KV leaves from the host: nothing to overlap
            return False
        if self.speculator is not None and not self.speculator.proposes_ahead:
            logger.warning("spec method %r proposes from each step's tokens, which the zero-bubble loop "
                           "reads a step late: running the synchronous loop", self.config.spec_method)
            return False
        return True

    def _attach_offload_tier(self) -> None:
        if not self.config.kv_offload_bytes:
            return
        self.kv.attach_tiers(group_tiers(self.layout, self.runner.kv_cache, self.config.kv_offload_bytes))

    # ---- intake -------------------------------------------------------------------
    def _new_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        output_token_ids: Sequence[int] = (), media: Sequence[MediaItem] = (), encode_media: bool = True,
    ) -> Request:
        prompt = list(prompt_token_ids)
        vocab = self.loaded.spec.vocab_size
        if any(t < 0 or t >= vocab for t in prompt) or any(t < 0 or t >= vocab for t in output_token_ids):
            raise InvalidRequestError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        if len(prompt) + len(output_token_ids) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt has {len(prompt)} tokens (and {len(output_token_ids)} already generated); this model's "
                f"context is {self.max_model_len} (and at least one token must be generated)",
                param="prompt",
            )
        inputs = self._media_inputs(request_id, prompt, media, encode_media) \
            if media or self.loaded.multimodal is not None else []
        self._arrivals += 1
        return Request(
            request_id, prompt, params, eos_token_ids=self.loaded.eos_token_ids,
            arrival_index=self._arrivals, output_token_ids=list(output_token_ids), media=inputs,
            bidirectional_images=bool(inputs) and self.loaded.multimodal.bidirectional_vision,
        )

    def _media_inputs(self, request_id: str, prompt: list[int], media: Sequence[MediaItem],
                      encode: bool) -> list[MediaInput]:
        """A prompt's media, checked against its placeholders and, when this engine computes the prompt, decoded
        and cut now (or found in the encoder cache), so that undecodable media is the caller's 400, never a
        failed step; the towers run at the step that reads them, batched with other requests' media. A
        handoff's media stay unprepared (their digests key the prefix cache; a preempted request encodes them
        when it recomputes)."""
        encoder, mm = self.loaded.media_encoder, self.loaded.multimodal
        if encoder is None or mm is None:
            raise InvalidRequestError("this model reads text only: images, audio and video cannot be given to it",
                                      param="messages")
        placeholders = {IMAGE: mm.image_token_id, AUDIO: mm.audio_token_id}
        if mm.video_token_id is not None:
            placeholders[VIDEO] = mm.video_token_id
        problem = check_placement(media, prompt, placeholders)
        if problem is not None:
            raise InvalidRequestError(problem, param="messages")
        inputs = [MediaInput(item) for item in media]
        if not inputs:
            return inputs
        if encode:
            for m in inputs:
                encoder.prepare_input(m)
        return inputs

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.scheduler.requests or any(r.request_id == request_id for r, _ in self._pending_handoffs) \
                or (self.remote is not None and self.remote.has(request_id)) or request_id in self.choices:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    output_token_ids: Sequence[int] = (), media: Sequence[MediaItem] = ()) -> None:
        """Compute the prompt here, then decode (colocated; a decode engine too, when the router finds a
        handoff would cost more than the prefill: a short prompt or a long prefix hit in its cache).

        `output_token_ids`: a migrated request's output so far (streamed by an instance that died). They are
        computed with the prompt, like a preempted request's, and count as output: against max_tokens, in the
        penalties' history and through the grammar; the request continues after them.
        `media`: the prompt's images and audio, at their placeholder tokens.
        """
        self._check_new_id(request_id)
        if output_token_ids:
            if params.n != 1:
                raise InvalidRequestError("a resumed request has one choice (n=1)", param="n")
            if len(output_token_ids) >= params.max_tokens:
                raise InvalidRequestError(f"{len(output_token_ids)} tokens already generated leave nothing of "
                                          f"max_tokens={params.max_tokens}", param="max_tokens")
        if params.n == 1:
            request = self._new_request(request_id, prompt_token_ids, params, output_token_ids, media)
            self.admit_new(request, num_steps_done=len(output_token_ids))
            return
        holder, followers = self._new_choices(request_id, prompt_token_ids, params, media=media)
        self.admit_new(holder)
        self.choices.hold(request_id, holder.request_id, followers)
        self._release_followers()

    def _new_choices(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     first_tokens: Sequence[FirstToken] = (), media: Sequence[MediaItem] = (),
                     ) -> tuple[Request, list[Request]]:
        """The validated requests of params.n choices: choice 0 (the holder), then its followers (handed-off
        choices, which come with their first tokens, do not encode their media)."""
        requests = [self._new_request(choice_id, prompt_token_ids, child_params(params, i),
                                      [first_tokens[i].token_id] if first_tokens else [], media, not first_tokens)
                    for i, choice_id in enumerate(self.choices.add(request_id, params.n))]
        return requests[0], requests[1:]

    def _release_followers(self) -> None:
        """Admit the followers of n > 1 requests whose holder has entered the scheduler (or left)."""
        def pending(holder_id: str) -> bool:
            return holder_id not in self.scheduler.requests and (self.remote is not None and self.remote.has(holder_id))

        for follower in self.choices.release(pending):
            self.admit_new(follower, num_steps_done=len(follower.output_token_ids))

    def admit_new(self, request: Request, num_steps_done: int = 0) -> None:
        """Hand a validated new request to the runner and the scheduler (`num_steps_done`: its first tokens
        were sampled elsewhere)."""
        self.runner.add_request(request.request_id, request.params.seed, num_steps_done,
                                logits=self._logits_state(request))
        self.scheduler.add_request(request)

    def _logits_state(self, request: Request) -> RequestLogits | None:
        """The request's logits-processing state (its grammar compiled now unless `prepare` did)."""
        return self.grammars.new_state(request.request_id, request.params, request.prompt_token_ids)

    def prepare(self, params: SamplingParams) -> None:
        """Work a request needs before it can be added, done on the caller's thread (compiling its
        grammar); raises InvalidRequestError for what cannot be served. Thread-safe."""
        self.grammars.prepare(params)

    # ---- handoffs through kv_transfer (see remote_kv.py) ----------------------------------
    def enable_remote_kv(self, push_mode: str = "layerwise", host: str = "127.0.0.1",
                         transfer_timeout_s: float = 30.0) -> RemoteKV:
        """Move KV through kv_transfer's slots (services call this once, before any request)."""
        self.remote = RemoteKV(self, push_mode, host, transfer_timeout_s)
        return self.remote

    def enable_kv_spill(self, calls: KVTransferCalls) -> KVSpill:
        """Decode role: park a preempted request's context in the kv_transfer its KV came through, and read it
        back when it resumes (kv_spill.py), instead of computing it again. After enable_remote_kv."""
        assert self.remote is not None, "enable_remote_kv first"
        spill = KVSpill(self, self.remote.agents, calls, self.remote.stats, self.remote.transfer_timeout_s)
        self.scheduler.on_preempt = spill.spill
        self.scheduler.on_resume = spill.swap_in
        self.spill = spill
        return spill

    def add_pushed_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                           address: AgentAddress, slots: HandoffSlots, media: Sequence[MediaItem] = ()) -> None:
        """Prefill role: compute the prompt (encoding its media), writing its KV into `slots` layer by layer."""
        assert self.remote is not None, "enable_remote_kv first"
        self._check_new_id(request_id)
        if params.n == 1:
            self.remote.add_pushed(self._new_request(request_id, prompt_token_ids, params, media=media), address,
                                   slots)
            return
        # n > 1: the holder ships the prompt's KV once; the followers only sample their first tokens
        holder, followers = self._new_choices(request_id, prompt_token_ids, params, media=media)
        holder.hand_off_always = True
        for follower in followers:
            follower.ships_kv = False
        self.remote.add_pushed(holder, address, slots)
        self.choices.hold(request_id, holder.request_id, followers)
        self._release_followers()

    def add_pulled_handoff(self, request_id: str, params: SamplingParams, claimed: ClaimedHandoff,
                           address: AgentAddress, more_choices: Sequence[FirstToken] = (),
                           media: Sequence[MediaItem] = ()) -> list[RequestOutput]:
        """Decode role: admit a request whose KV waits in kv_transfer's slots (pulled before it runs).

        `more_choices`: with params.n > 1, the first tokens prefill sampled for choices 1..n-1 (choice 0's
        travels with the handoff). Returns the final outputs of choices their first token already ended.
        `media`: the prompt's images and audio (their digests key this engine's prefix cache).
        """
        assert self.remote is not None, "enable_remote_kv first"
        self._check_new_id(request_id)
        self.remote.check_compatible(claimed)
        result = claimed.result
        firsts = [FirstToken(result.first_token_id, result.first_logprobs), *more_choices]
        if len(firsts) != params.n:
            raise InvalidRequestError(f"n={params.n} choices need {params.n} first tokens, got {len(firsts)}",
                                      param="n")
        prompt = claimed.spec.prompt_token_ids
        if params.n == 1:
            request, done = self._continue_from_first_token(request_id, prompt, params, firsts[0].token_id,
                                                            firsts[0].logprobs, media)
            if done is None:
                self.remote.add_pulled(request, claimed, address)
            return [done] if done is not None else []
        holder, followers = self._new_choices(request_id, prompt, params, firsts, media)
        return self._admit_pulled_choices(request_id, claimed, address, [holder, *followers], firsts)

    def _admit_pulled_choices(self, request_id: str, claimed: ClaimedHandoff, address: AgentAddress,
                              requests: list[Request], firsts: list[FirstToken]) -> list[RequestOutput]:
        """The first choice that goes on pulls the KV; the other ones that go on follow it."""
        done: list[RequestOutput] = []
        going_on: list[Request] = []
        for request, first in zip(requests, firsts, strict=True):
            if first.logprobs is not None:
                request.output_logprobs.append(first.logprobs)
            status = request.check_stop()
            if status is None:
                going_on.append(request)
                continue
            request.status = status
            done.append(self.choices.to_request_output(RequestOutput(
                request.request_id, [], [], True, request.finish_reason, request.num_prompt_tokens, 0)))
        if not going_on:
            return done
        holder, followers = going_on[0], going_on[1:]
        for follower in followers:
            follower.kv_home = address.space.agent_name  # the holder's is set as it pulls
        self.runner.add_request(holder.request_id, holder.params.seed, num_steps_done=1,
                                logits=self._logits_state(holder))
        assert self.remote is not None
        self.remote.add_pulled(holder, claimed, address)
        self.choices.hold(request_id, holder.request_id, followers)
        self._release_followers()
        return done

    def take_failures(self) -> list[tuple[str, BatonError]]:
        """Requests that failed outside a step's outputs (a KV pull broke), each reported once; a choice's
        failure fails its whole request (its other choices are aborted)."""
        failures = self.remote.take_failures() if self.remote is not None else []
        out = []
        for engine_id, error in failures:
            request_id, _ = self.choices.failed_request_id(engine_id)
            if request_id != engine_id:
                self.abort(request_id)
            out.append((request_id, error))
        return out

    @property
    def hidden_width(self) -> int:
        """Columns of the hidden states a prefill engine hands out: final, then each auxiliary layer's."""
        return self.loaded.spec.hidden_size * (1 + len(self.config.aux_hidden_layers))

    def spec_add_hidden(self, request_id: str, hidden_states: torch.Tensor, start: int) -> None:
        """Prompt hidden states from prefill (rows from prompt position `start`), for the draft head.

        The head here reads the final hidden states: the first `hidden_size` columns (auxiliary layers follow).
        """
        if self.speculator is not None:
            self.speculator.add_hidden_states(request_id, hidden_states[:, : self.loaded.spec.hidden_size], start)

    def add_handoff(self, request_id: str, params: SamplingParams, handoff: KVHandoff) -> RequestOutput | None:
        """Admit a request prefilled elsewhere. Returns its final output if the first token ended it."""
        if handoff.block_size != self.config.block_size:
            raise InvalidRequestError(
                f"handoff block size {handoff.block_size} != engine block size {self.config.block_size}"
            )
        self._check_new_id(request_id)
        check_handoff_kv(self.layout, handoff.kv, len(handoff.prompt_token_ids))
        request, done = self._continue_from_first_token(request_id, handoff.prompt_token_ids, params,
                                                        handoff.first_token_id, handoff.first_logprobs,
                                                        handoff.media)
        if done is not None:
            return done
        self._spec_add_handoff(request_id, handoff)
        self._pending_handoffs.append((request, handoff))
        self._admit_handoffs()
        return None

    def _continue_from_first_token(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, first_token_id: int,
        first_logprobs: TokenLogprobs | None, media: Sequence[MediaItem] = (),
    ) -> tuple[Request, RequestOutput | None]:
        """A request prefilled elsewhere, holding its first token; its final output if that token ended it.

        Otherwise the runner has taken it (its generator replays the draws prefill made).
        """
        request = self._new_request(request_id, prompt_token_ids, params, [first_token_id], media, False)
        if first_logprobs is not None:
            request.output_logprobs.append(first_logprobs)
        status = request.check_stop()
        if status is not None:
            request.status = status
            return request, RequestOutput(request_id, [], [], True, request.finish_reason,
                                          request.num_prompt_tokens, 0)
        self.runner.add_request(request_id, params.seed, num_steps_done=1, logits=self._logits_state(request))
        return request, None

    def _admit_handoffs(self) -> None:
        """Move handed-off requests in as blocks allow (FIFO; the head waits for room)."""
        while self._pending_handoffs:
            request, handoff = self._pending_handoffs[0]
            if self.scheduler.num_running >= self.config.max_num_seqs:
                return
            if not self.kv.allocate_slots(request, request.num_prompt_tokens, host_writes=True):
                return
            self._pending_handoffs.popleft()
            inject_kv(self.layout, self.runner.kv_cache, self.kv.tables(request.request_id), handoff.kv,
                      request.num_prompt_tokens)
            request.num_computed_tokens = request.num_prompt_tokens
            self.scheduler.add_running(request)

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is (every choice of it, or one choice by its own id); its blocks are
        freed exactly once."""
        child_ids, dropped_held = self.choices.abort(request_id)
        if not child_ids:
            return self._abort_one(request_id)
        found = [self._abort_one(child_id) for child_id in child_ids]
        return any(found) or dropped_held

    def _abort_one(self, request_id: str) -> bool:
        self.runner.remove_request(request_id)
        self._spec_remove(request_id)
        self._hidden.pop(request_id, None)
        if self.remote is not None and self.remote.abort(request_id):
            return True
        for i, (request, _) in enumerate(self._pending_handoffs):
            if request.request_id == request_id:
                del self._pending_handoffs[i]
                request.status = RequestStatus.FINISHED_ABORTED
                return True
        return self.scheduler.abort(request_id)

    # ---- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of the loop; outputs of n > 1 requests come under the request's id with their index."""
        return [self.choices.to_request_output(out) for out in self._step()]

    def _step(self) -> list[RequestOutput]:
        if self.remote is not None and self.scheduler.has_unfinished():
            self.remote.settle_pushes(_PUSH_SETTLE_S)  # a computed prompt's first token before another step
        released = self.remote.poll() if self.remote is not None else []
        if released and not self.async_scheduling:
            return released  # out now, not after the step below (which may be another prompt's long prefill)
        self._admit_handoffs()
        if self.remote is not None:
            self.remote.admit_pulls()
        self._release_followers()
        self._spec_propose()
        plan = self.scheduler.schedule()
        for request_id in plan.preempted_ids:
            self._hidden.pop(request_id, None)  # recomputed from scratch on resume
            if self.remote is not None:
                self.remote.pusher.restart(request_id)  # its blocks are gone: no write may read them
        if self.async_scheduling:
            return released + self._step_overlapped(plan, bool(released))
        if plan.is_empty:
            self._idle(False)
            return []
        hook = self.remote.layer_hook(plan) if self.remote is not None else None
        out = self._execute(self.runner.prepare(plan), None, hook)
        return self._resolve(out)

    def _execute(self, inputs: StepInputs, prev: StepOutput | None, hook: LayerDoneFn | None) -> StepOutput:
        """Run a step on this thread (the engine's, or the zero-bubble loop's executor)."""
        if self.before_step is not None:
            self.before_step()
        if self.between_layers is not None and inputs.plan.num_tokens >= _LONG_STEP_TOKENS:
            hook = _then(hook, self.between_layers)
        try:
            return self.runner.execute(inputs, prev, hook)
        finally:
            if self.after_step is not None:
                self.after_step()

    def _idle(self, produced: bool) -> None:
        """Nothing runnable this step: the wait that follows is no bubble."""
        self.runner.clock.pause()
        if self.remote is not None and self.remote.busy and not produced:
            time.sleep(_TRANSFER_POLL_S)  # only transfers in flight: do not spin a core they may need

    def _step_overlapped(self, plan: SchedulerPlan, produced: bool) -> list[RequestOutput]:
        """Zero-bubble loop: submit `plan` as soon as the step in flight ends, then read that step."""
        prev = self._in_flight
        inputs = None if plan.is_empty else self.runner.prepare(plan, prev.inputs.rows if prev else None)
        done: StepOutput | None = None
        if prev is not None:
            self._in_flight = None
            try:
                done = prev.future.result()
            finally:
                self.kv.release_held_frees()  # the step that might still write them has ended
        if inputs is not None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="executor")
            self.kv.hold_frees()
            self._in_flight = _InFlight(inputs, self._executor.submit(self._execute, inputs, done, None))
        else:
            self._idle(produced or done is not None)
        return self._resolve(done) if done is not None else []

    def _resolve(self, out: StepOutput) -> list[RequestOutput]:
        """Read a finished step's results: stream tokens, check stops, free what finished."""
        result = out.result()
        self._spec_observe(out.plan, result)
        for request_id, hidden in result.hidden_states.items():
            self._hidden.setdefault(request_id, []).append(hidden)
        outputs = self.scheduler.update(out.plan, result)
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            self.runner.clock.pause()  # out of work until the next request
        # a pushed prefill's final output waits for its last writes (see remote_kv.py)
        return [o for o in outputs if not (o.finished and self._finish(o))]

    def _finish(self, out: RequestOutput) -> bool:
        """Wrap up a finished request; True when its output is withheld until its KV push is over."""
        self.runner.remove_request(out.request_id)
        self._spec_remove(out.request_id)
        hidden = self._hidden.pop(out.request_id, [])
        if out.finish_reason != "handoff":
            if self.remote is not None:
                self.remote.pusher.abort(out.request_id)  # the first token ended it: nothing to hand over
            return False
        request = self.scheduler.handoff_pending[out.request_id]
        if not request.ships_kv:  # a follower of n > 1 choices: the holder ships the prompt's KV
            self.scheduler.release_handoff(out.request_id)
            return False
        hidden_states = torch.cat(hidden) if hidden else None
        if self.remote is not None and self.remote.withhold(out, request, hidden_states):
            return True
        try:
            out.handoff = KVHandoff(
                prompt_token_ids=list(request.prompt_token_ids),
                first_token_id=request.output_token_ids[0],
                first_logprobs=request.output_logprobs[0] if request.output_logprobs else None,
                block_size=self.config.block_size,
                kv=extract_kv(self.layout, self.runner.kv_cache, self.kv.tables(out.request_id),
                              request.num_prompt_tokens),
                hidden_states=hidden_states if hidden_states is not None else torch.empty(
                    0, self.loaded.spec.hidden_size),
                media=tuple(m.item for m in request.media),
            )
        finally:
            self.scheduler.release_handoff(out.request_id)
        return False

    # ---- speculation (see shared/spec/speculator.py) ----------------------------------
    def _spec_propose(self) -> None:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)

    def _spec_observe(self, plan: SchedulerPlan, result: StepResult) -> None:
        if self.speculator is not None:  # not chunks whose request ended while they ran (zero-bubble loop)
            current = [c for c in plan.chunks if self.scheduler.is_current(c)]
            self.speculator.observe(SchedulerPlan(current), result)

    def _spec_add_handoff(self, request_id: str, handoff: KVHandoff) -> None:
        """The prefill engine's hidden states are the draft head's prompt features."""
        self.spec_add_hidden(request_id, handoff.hidden_states, handoff.hidden_start)

    def _spec_remove(self, request_id: str) -> None:
        if self.speculator is not None:
            self.speculator.remove_request(request_id)

    # ---- conveniences ---------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_handoffs) or self._in_flight is not None or (
            self.remote is not None and self.remote.busy) or self.choices.num_held > 0

    def run_to_completion(self, on_output: Callable[[RequestOutput], None] | None = None
                          ) -> dict[str, GenerationResult]:
        """Step until every request has finished; results keyed by request id (choice i > 0 of an n > 1
        request: `choice_request_id(request_id, i)`).

        `on_output` sees every output as it comes (progress of long batches).
        """
        results: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for out in self.step():
                if on_output is not None:
                    on_output(out)
                key = out.request_id if out.index == 0 else choice_request_id(out.request_id, out.index)
                res = results.setdefault(
                    key,
                    GenerationResult(out.request_id, [], None, num_prompt_tokens=out.num_prompt_tokens,
                                     num_cached_tokens=out.num_cached_tokens),
                )
                res.token_ids.extend(out.new_token_ids)
                res.logprobs.extend(out.new_logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    res.handoff = out.handoff  # type: ignore[assignment]
        return results

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None = None,
        media: Sequence[Sequence[MediaItem]] | None = None,
    ) -> list[GenerationResult]:
        """Run a batch of prompts to completion (continuous batching inside): a result per prompt, or per
        choice with n > 1 (a prompt's choices in a row). `media`: each prompt's images and audio."""
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        media_list = list(media) if media is not None else [()] * len(prompts)
        for request_id, prompt, p, items in zip(ids, prompts, param_list, media_list, strict=True):
            self.add_request(request_id, prompt, p, media=items)
        results = self.run_to_completion(on_output)
        return [results[choice_request_id(i, k) if k else i] for i, p in zip(ids, param_list, strict=True)
                for k in range(p.n)]

    # ---- stats ----------------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_pending_handoffs(self) -> int:
        """Handed-off requests waiting for blocks (decode role)."""
        return len(self._pending_handoffs) + (self.remote.num_queued if self.remote is not None else 0)

    def close(self) -> None:
        """Stop the executor thread (the zero-bubble loop's), waiting for the step it runs, and the mask worker.

        The engine stays usable: a later step starts a new one.
        """
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.runner.masks.close()

    def check_no_leaks(self) -> None:
        assert not self.has_unfinished(), "requests still in flight"
        self.choices.check_no_leaks()
        self.kv.check_no_leaks()
        if self.speculator is not None:
            self.speculator.check_no_leaks()


def _then(hook: LayerDoneFn | None, after: Callable[[], None]) -> LayerDoneFn:
    """`hook` (if any), then `after`, at the end of each layer."""
    def on_layer_done(layer: int) -> None:
        if hook is not None:
            hook(layer)
        after()
    return on_layer_done
