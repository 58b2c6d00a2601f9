"""Prefill's push: each layer's finished KV blocks written to kv_transfer while later layers compute.

Per request, a push job knows the slots kv_transfer reserved for it. Each
step, the blocks that become final in that step (all their tokens computed,
or the prompt's last, partial block) are written layer by layer from the
model's `on_layer_done` hook, so the transfer of layer l overlaps the compute
of layers l+1..L-1. Blocks the prefix pool already holds are never sent::

    attach ─► step: layer 0 done ─► WRITE blocks' layer 0 ─► ... layer L-1 ─► WRITE ...
          ─► (more chunks) ─► first token: finish(hidden states) ─► WRITE hidden ─► poll: DONE | FAILED

In `after_prefill` mode (the baseline the TTFT benchmark compares with)
nothing moves until the first token; then every block goes at once. Blocks
are held by the engine until `poll` reports the job over (or `abort`), so
no transfer ever reads a block that was given to another request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.kv_link import KVAgents, RequestTransfers, TransferGroup
from shared.engine.scheduler import SchedulerPlan
from shared.kv.layout import KVLayout, cdiv
from shared.kv.remote import AgentAddress, HandoffResult, HandoffSlots, block_plan, slots_plan
from shared.transport.base import TransferOp, TransferState

logger = logging.getLogger(__name__)

PUSH_MODES = ("layerwise", "after_prefill")


@dataclass
class PushOutcome:
    """How a request's push ended: what to Commit, or why it failed."""

    result: HandoffResult | None
    error: str | None
    nbytes: int
    seconds: float


@dataclass
class _PushJob:
    group: TransferGroup
    slots: HandoffSlots
    num_prompt_tokens: int
    block_ids: list[int]
    num_blocks_sent: int = 0  # blocks [0, num_blocks_sent) are final and on their way (or present)
    result: HandoffResult | None = None  # set by finish: the job ends when its transfers do

    def unsent(self, lo: int, hi: int) -> tuple[list[int], list[int]]:
        """Local block ids and slots of blocks [lo, hi) that the pool does not already hold."""
        idx = [i for i in range(lo, hi) if not self.slots.present[i]]
        return [self.block_ids[i] for i in idx], [self.slots.block_slots[i] for i in idx]


class KVPusher(RequestTransfers[_PushJob]):
    def __init__(self, agents: KVAgents, layout: KVLayout, mode: str = "layerwise") -> None:
        if mode not in PUSH_MODES:
            raise ValueError(f"push mode must be one of {PUSH_MODES}, got {mode!r}")
        super().__init__()
        self._agents = agents
        self._layout = layout
        self._mode = mode

    def attach(self, request_id: str, address: AgentAddress, slots: HandoffSlots, num_prompt_tokens: int) -> None:
        """Push this request's KV to `slots` as it is computed."""
        self._jobs[request_id] = _PushJob(TransferGroup(self._agents.link(address)), slots, num_prompt_tokens, [])

    def layer_hook(self, plan: SchedulerPlan) -> Callable[[int], None] | None:
        """The `on_layer_done` callback for this step (None when nothing is to be pushed layer-wise)."""
        if self._mode != "layerwise":
            return None
        work: list[tuple[_PushJob, list[int], list[int]]] = []
        bs = self._layout.block_size
        for chunk in plan.chunks:
            job = self._jobs.get(chunk.request_id)
            if job is None or job.result is not None:
                continue
            job.block_ids = chunk.block_ids
            end = chunk.start_pos + chunk.num_tokens
            final = cdiv(end, bs) if end >= job.num_prompt_tokens else end // bs
            block_ids, slots = job.unsent(job.num_blocks_sent, final)
            job.num_blocks_sent = final
            if block_ids:
                work.append((job, block_ids, slots))
        if not work:
            return None

        def on_layer_done(layer: int) -> None:
            for job, block_ids, slots in work:
                job.group.start(TransferOp.WRITE, block_plan(self._layout, job.group.link.cache_region, block_ids,
                                                              job.slots.space, slots, [layer]))
                job.group.poll()  # progress the earlier layers' transfers (backends without their own thread)

        return on_layer_done

    def finish(self, request_id: str, block_ids: list[int], result: HandoffResult,
               hidden: torch.Tensor | None) -> None:
        """The first token is out: send what is left (everything, after_prefill) and the hidden states."""
        job = self._jobs[request_id]
        job.block_ids = block_ids
        if job.num_blocks_sent < len(job.slots.block_slots):
            ids, slots = job.unsent(job.num_blocks_sent, len(job.slots.block_slots))
            job.group.start(TransferOp.WRITE, block_plan(self._layout, job.group.link.cache_region, ids,
                                                          job.slots.space, slots, range(self._layout.num_layers)))
            job.num_blocks_sent = len(job.slots.block_slots)
        if hidden is not None and hidden.numel():
            staged = hidden.to(self._layout.dtype).contiguous()  # [num_hidden_tokens, hidden_width]
            region = job.group.register(staged)
            job.group.start(TransferOp.WRITE, slots_plan(region, 0, staged.numel() * staged.element_size(),
                                                         job.slots.space, job.slots.hidden_slots))
        job.result = result

    def poll(self) -> dict[str, PushOutcome]:
        """Finished jobs whose transfers are over, by request id (each reported once)."""
        over: dict[str, PushOutcome] = {}
        for request_id, job in list(self._jobs.items()):
            if job.result is None:
                continue  # the prompt is still computing; a failure so far is reported when it is done
            state = job.group.poll()
            if state is not TransferState.PENDING:
                over[request_id] = self._end(request_id, job, state)
        return over

    def _end(self, request_id: str, job: _PushJob, state: TransferState) -> PushOutcome:
        del self._jobs[request_id]
        job.group.close()
        failed = state is TransferState.FAILED
        outcome = PushOutcome(None if failed else job.result, job.group.error if failed else None,
                              job.group.nbytes, job.group.seconds)
        if failed:
            logger.warning("request %s: KV push failed: %s", request_id, outcome.error)
        return outcome

    def restart(self, request_id: str) -> None:
        """The request was preempted (its blocks freed, to be recomputed): stop its writes, send all again."""
        job = self._jobs.get(request_id)
        if job is not None:
            job.group.restart()
            job.num_blocks_sent = 0
