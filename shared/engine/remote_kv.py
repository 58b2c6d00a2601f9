"""An engine's handoffs through kv_transfer: prefix import and layer-wise push (prefill), pull (decode).

Prefill role, one request::

    add_pushed ─► pool holds a prefix we lack? ─► import (READ into fresh blocks, cached locally, freed)
               ─► admitted: chunks run, each layer's final blocks WRITTEN as the layer finishes
               ─► first token: hidden states WRITTEN; final output withheld until the writes are over
               ─► output.handoff = PushOutcome (the servicer Commits it, or reports the failure)

Decode role, one request::

    add_pulled ─► queued until blocks and a batch slot are free ─► blocks reserved (own prefix hits kept)
               ─► READ only the missing blocks (+ hidden states) ─► running; a failed pull fails the request

The engine holds every block until the transfers touching it are over or
aborted; `abort` works in every state and frees exactly once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from shared.engine.kv_link import KVAgents
from shared.engine.kv_pull import KVPuller, PullOutcome, PullSource
from shared.engine.kv_push import KVPusher, PushOutcome
from shared.engine.kv_stats import KVTransferStats
from shared.engine.request import Request, RequestOutput, RequestStatus
from shared.errors import BatonError, InvalidRequestError, KVTransferError
from shared.kv.remote import AgentAddress, ClaimedHandoff, HandoffResult, HandoffSlots, usable_pool_prefix

if TYPE_CHECKING:
    from shared.engine.block_pool import BlockPool
    from shared.engine.config import EngineConfig
    from shared.engine.kv_manager import KVCacheManager
    from shared.engine.runner import ModelRunner
    from shared.engine.scheduler import Scheduler, SchedulerPlan
    from shared.kv.layout import KVLayout
    from shared.models.loader import LoadedModel


class HandoffEngine(Protocol):
    """What RemoteKV reads of the engine it serves (LLMEngine): the cache, its tables, and admission."""

    config: EngineConfig
    loaded: LoadedModel
    layout: KVLayout
    runner: ModelRunner
    kv: KVCacheManager
    pool: BlockPool
    scheduler: Scheduler

    def admit_new(self, request: Request, num_steps_done: int = 0) -> None: ...

    def spec_add_hidden(self, request_id: str, hidden_states: torch.Tensor, start: int) -> None: ...

logger = logging.getLogger(__name__)
_SETTLE_POLL_S = 0.0005


@dataclass
class _Import:
    holder: Request  # owns the import's blocks until they are cached
    request: Request  # admitted when the import is over
    address: AgentAddress
    slots: HandoffSlots
    num_read_tokens: int  # what the pool supplies beyond the local prefix cache


@dataclass
class _Pull:
    request: Request
    claimed: ClaimedHandoff
    address: AgentAddress


class RemoteKV:
    def __init__(self, engine: HandoffEngine, push_mode: str, host: str, transfer_timeout_s: float) -> None:
        self._e = engine
        self.transfer_timeout_s = transfer_timeout_s
        self.agents = KVAgents(engine.config.role, engine.runner.kv_cache, host=host,
                               transfer_timeout_s=transfer_timeout_s)
        self.pusher = KVPusher(self.agents, engine.layout, push_mode)
        self.puller = KVPuller(self.agents, engine.layout, engine.runner.kv_cache)
        self._imports: dict[str, _Import] = {}  # by the holder's id
        self._queued: deque[_Pull] = deque()
        self._pulling: dict[str, _Pull] = {}
        self._withheld: dict[str, RequestOutput] = {}  # prefill: final outputs waiting for their push
        self.failures: list[tuple[str, BatonError]] = []
        self.stats = KVTransferStats()

    @property
    def busy(self) -> bool:
        return bool(self._imports or self._queued or self._pulling or self.pusher.num_jobs)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def has(self, request_id: str) -> bool:
        return any(i.request.request_id == request_id for i in self._imports.values()) or any(
            p.request.request_id == request_id for p in self._queued) or request_id in self._pulling

    # ---- prefill ----------------------------------------------------------------------
    def add_pushed(self, request: Request, address: AgentAddress, slots: HandoffSlots) -> None:
        """Admit a prefill request whose KV goes to `slots`, importing the pool's prefix first."""
        e = self._e
        bs = e.config.block_size
        # at least one prompt token is computed here: its step samples the first token
        num_pool_blocks = usable_pool_prefix(e.layout, slots.present, request.num_prompt_tokens,
                                             (request.num_prompt_tokens - 1) // bs)
        local = e.kv.find_cached_prefix(request)
        if num_pool_blocks > len(local) and e.pool.enable_prefix_caching:  # imports land in the prefix cache
            # the request's media too: they key the imported blocks' prefix hashes as the request's own
            holder = Request(f"import:{request.request_id}", list(request.prompt_token_ids), request.params,
                             eos_token_ids=request.eos_token_ids, media=request.media)
            if e.kv.allocate_slots(holder, num_pool_blocks * bs, local, host_writes=True):
                num_read_tokens = (num_pool_blocks - len(local)) * bs
                self._imports[holder.request_id] = _Import(holder, request, address, slots, num_read_tokens)
                source = PullSource(e.layout, slots, num_pool_blocks * bs, handoff_tokens=request.num_prompt_tokens)
                self.puller.start(holder.request_id, address, source, e.kv.tables(holder.request_id), len(local) * bs)
                return
        self._admit_pushed(request, address, slots)

    def _admit_pushed(self, request: Request, address: AgentAddress, slots: HandoffSlots) -> None:
        self._e.admit_new(request)
        self.pusher.attach(request.request_id, address, slots, request.num_prompt_tokens)

    def _import_over(self, imp: _Import, outcome: PullOutcome) -> None:
        e = self._e
        if outcome.error is None:
            imp.holder.num_computed_tokens = len(e.kv.block_ids(imp.holder.request_id)) * e.config.block_size
            e.kv.cache_full_blocks(imp.holder)  # now local prefix-cache hits for the request
            self.stats.imported_tokens += imp.num_read_tokens
        e.kv.free(imp.holder)
        self._admit_pushed(imp.request, imp.address, imp.slots)

    def layer_hook(self, plan: SchedulerPlan) -> Callable[[int], None] | None:
        return self.pusher.layer_hook(plan)

    def withhold(self, out: RequestOutput, request: Request, hidden_states: torch.Tensor | None) -> bool:
        """A prefill request reached its first token: start its last writes and hold its output."""
        if out.request_id not in self.pusher:
            return False
        result = HandoffResult(
            request.output_token_ids[0], request.output_logprobs[0] if request.output_logprobs else None,
            hidden_states.shape[-1] if hidden_states is not None else 0,
            hidden_states.shape[0] if hidden_states is not None else 0,
        )
        self.pusher.finish(out.request_id, self._e.kv.tables(out.request_id), result, hidden_states)
        self._withheld[out.request_id] = out
        return True

    # ---- decode -----------------------------------------------------------------------
    def check_compatible(self, claimed: ClaimedHandoff) -> None:
        problems = []
        if claimed.spec.model != self._e.loaded.identity:
            problems.append(f"model {claimed.spec.model} != {self._e.loaded.identity}")
        try:
            self.puller.check_compatible(claimed.spec.layout)
        except ValueError as err:
            problems.append(str(err))
        if problems:
            raise InvalidRequestError(f"handoff {claimed.spec.handoff_id} does not fit this engine: "
                                      + "; ".join(problems))

    def add_pulled(self, request: Request, claimed: ClaimedHandoff, address: AgentAddress) -> None:
        request.kv_home = address.space.agent_name  # where a preemption parks its context (kv_spill.py)
        self._queued.append(_Pull(request, claimed, address))
        self.admit_pulls()

    def admit_pulls(self) -> None:
        """Reserve blocks for queued pulls (FIFO; the head waits for room) and start their reads."""
        e = self._e
        while self._queued:
            pull = self._queued[0]
            request = pull.request
            if e.scheduler.num_running + len(self._pulling) >= e.config.max_num_seqs:
                return
            cached = e.kv.find_cached_prefix(request)
            if not e.kv.allocate_slots(request, request.num_prompt_tokens, cached, host_writes=True):
                return
            self._queued.popleft()
            request.num_cached_tokens = len(cached) * e.config.block_size
            result = pull.claimed.result
            source = PullSource(pull.claimed.spec.layout, pull.claimed.slots, request.num_prompt_tokens,
                                (result.num_hidden_tokens, result.hidden_width))
            self._pulling[request.request_id] = pull
            self.puller.start(request.request_id, pull.address, source, e.kv.tables(request.request_id),
                              request.num_cached_tokens)

    def _pull_over(self, pull: _Pull, outcome: PullOutcome) -> None:
        e, request = self._e, pull.request
        if outcome.error is not None:
            e.kv.free(request)
            request.status = RequestStatus.FINISHED_ABORTED
            e.runner.remove_request(request.request_id)
            self.agents.forget(pull.address)  # its agent may have restarted: fetch fresh metadata next time
            self.failures.append((request.request_id, KVTransferError(
                f"request {request.request_id}: pulling its KV from kv_transfer failed: {outcome.error}")))
            return
        request.num_computed_tokens = request.num_prompt_tokens
        logger.info("request %s: pulled %d bytes (%d of %d prompt tokens were cached here) in %.1f ms, %.2f GB/s",
                    request.request_id, outcome.nbytes, request.num_cached_tokens, request.num_prompt_tokens,
                    outcome.seconds * 1000, outcome.nbytes / max(outcome.seconds, 1e-9) / 1e9)
        if outcome.hidden_states is not None:
            e.spec_add_hidden(request.request_id, outcome.hidden_states,
                              request.num_prompt_tokens - outcome.hidden_states.shape[0])
        e.scheduler.add_running(request)

    def settle_pushes(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, until a prefill whose writes are all posted has them over (at once when
        none is waiting on its writes).

        Its first token is withheld until then, and the engine looks again only between steps: when the last
        writes end just after the step that posted them, the next step (another prompt's prefill, hundreds of
        ms on a CPU) would hold that token back for its whole length. In a 1P1D run at 1 request/s on 2 cores
        (bench/plan_validate.py, 2026-11-27), prompts followed by another one waited 200-450 ms past their
        writes, timed with log lines at the router's send, the prefill's admission and its reply."""
        if not self.pusher.num_finishing:  # the usual case, every step of a decode engine
            return
        deadline = time.monotonic() + timeout_s
        while not self.pusher.any_over() and time.monotonic() < deadline:
            time.sleep(_SETTLE_POLL_S)  # not a spin: a transport without its own thread progresses in any_over

    # ---- both ---------------------------------------------------------------------------
    def poll(self) -> list[RequestOutput]:
        """Finish what the transfers finished; returns prefill outputs released by their push."""
        for holder_id, outcome in self.puller.poll().items():
            direction = "import" if holder_id in self._imports else "pull"
            self.stats.observe(direction, outcome.seconds, outcome.nbytes, outcome.error is not None)
            if holder_id in self._imports:
                self._import_over(self._imports.pop(holder_id), outcome)
            else:
                self._pull_over(self._pulling.pop(holder_id), outcome)
        released = []
        for request_id, push in self.pusher.poll().items():
            self.stats.observe("push", push.seconds, push.nbytes, push.error is not None)
            out = self._withheld.pop(request_id)
            out.handoff = push
            self._e.scheduler.release_handoff(request_id)
            released.append(out)
        return released

    def abort(self, request_id: str) -> bool:
        """Stop and forget the request's transfers; frees blocks it holds outside the scheduler."""
        e = self._e
        self.pusher.abort(request_id)  # its blocks are the scheduler's, freed there
        self._withheld.pop(request_id, None)
        for holder_id, imp in list(self._imports.items()):
            if imp.request.request_id == request_id:
                self.puller.abort(holder_id)
                del self._imports[holder_id]
                e.kv.free(imp.holder)
                imp.request.status = RequestStatus.FINISHED_ABORTED
                return True
        for pull in list(self._queued):
            if pull.request.request_id == request_id:
                self._queued.remove(pull)
                pull.request.status = RequestStatus.FINISHED_ABORTED
                return True
        pulling = self._pulling.pop(request_id, None)
        if pulling is not None:
            self.puller.abort(request_id)
            e.kv.free(pulling.request)
            pulling.request.status = RequestStatus.FINISHED_ABORTED
            return True
        return False

    def take_failures(self) -> list[tuple[str, BatonError]]:
        failures, self.failures = self.failures, []
        return failures

    def close(self) -> None:
        for request_id in [*self._withheld, *(p.request.request_id for p in self._queued), *self._pulling,
                           *(i.request.request_id for i in self._imports.values())]:
            self.abort(request_id)
        self.pusher.abort_all()
        self.agents.close()


__all__ = ["PushOutcome", "RemoteKV"]
