"""Prefill's push: finished layers' KV blocks written to kv_transfer while later layers compute.

Per request, a push job knows the slots kv_transfer reserved for it. Each
step, the blocks that become final in that step (all their tokens computed,
or the prompt's last, partial block) are written from the model's
`on_layer_done` hook, LAYERS_PER_WRITE layers at a time, so the transfer of
layers l-3..l overlaps the compute of layers l+1..L-1. Blocks the prefix pool
already holds are never sent::

    attach ─► step: layers 0-3 done ─► WRITE blocks' layers 0-3 ─► ... layer L-1 ─► WRITE ...
          ─► (more chunks) ─► first token: finish(hidden states) ─► WRITE hidden ─► poll: DONE | FAILED

In `after_prefill` mode (the baseline the TTFT benchmark compares with)
nothing moves until the first token; then every block goes at once. Blocks
are held by the engine until `poll` reports the job over (or `abort`), so
no transfer ever reads a block that was given to another request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.engine.kv_link import KVAgents, RequestTransfers, TransferGroup
from shared.engine.scheduler import SchedulerPlan
from shared.kv.layout import KVLayout, cdiv
from shared.kv.remote import AgentAddress, HandoffResult, HandoffSlots, block_plan, slots_plan
from shared.transport.base import TransferOp, TransferState

logger = logging.getLogger(__name__)

PUSH_MODES = ("layerwise", "after_prefill")
# Layer-wise, one write per this many finished layers: posting a NIXL write costs the engine thread ~0.3 ms
# whatever its size (descriptor lists, initialize_xfer, post), 8.5-12 ms of a 256-token int8 prefill of SmolLM2's
# 30 layers when each layer is its own write, while the bytes of 4 layers move in well under a layer's compute
LAYERS_PER_WRITE = 4


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
    unit_of: dict[tuple[int, int], int]  # (layer group, block index) -> its unit (slot) of the handoff
    tables: list[list[int]] = field(default_factory=list)  # the request's block table in each layer group
    num_blocks_sent: int = 0  # blocks [0, num_blocks_sent) are final and on their way (or present)
    result: HandoffResult | None = None  # set by finish: the job ends when its transfers do

    def unsent(self, lo: int, hi: int) -> list[tuple[int, list[int], list[int]]]:
        """(layer group, local block ids, slots) of the units of blocks [lo, hi) the pool does not already hold."""
        out = []
        for g, table in enumerate(self.tables):
            units = [(i, self.unit_of[(g, i)]) for i in range(lo, hi) if (g, i) in self.unit_of]
            units = [(i, u) for i, u in units if not self.slots.present[u]]
            if units:
                out.append((g, [table[i] for i, _ in units], [self.slots.block_slots[u] for _, u in units]))
        return out


class KVPusher(RequestTransfers[_PushJob]):
    def __init__(self, agents: KVAgents, layout: KVLayout, mode: str = "layerwise",
                 layers_per_write: int | None = None) -> None:
        """`layers_per_write`: None = LAYERS_PER_WRITE (read when the pusher is made)."""
        if mode not in PUSH_MODES:
            raise ValueError(f"push mode must be one of {PUSH_MODES}, got {mode!r}")
        layers_per_write = LAYERS_PER_WRITE if layers_per_write is None else layers_per_write
        if layers_per_write < 1:
            raise ValueError(f"layers_per_write must be >= 1, got {layers_per_write}")
        super().__init__()
        self._agents = agents
        self._layout = layout
        self._mode = mode
        self._layers_per_write = layers_per_write

    def attach(self, request_id: str, address: AgentAddress, slots: HandoffSlots, num_prompt_tokens: int) -> None:
        """Push this request's KV to `slots` as it is computed."""
        unit_of = {unit: u for u, unit in enumerate(self._layout.handoff_units(num_prompt_tokens))}
        self._jobs[request_id] = _PushJob(TransferGroup(self._agents.link(address)), slots, num_prompt_tokens,
                                          unit_of)

    def layer_hook(self, plan: SchedulerPlan) -> Callable[[int], None] | None:
        """The `on_layer_done` callback for this step (None when nothing is to be pushed layer-wise)."""
        if self._mode != "layerwise":
            return None
        work: list[tuple[_PushJob, list[tuple[int, list[int], list[int]]]]] = []
        bs = self._layout.block_size
        for chunk in plan.chunks:
            job = self._jobs.get(chunk.request_id)
            if job is None or job.result is not None:
                continue
            job.tables = [chunk.block_ids, *chunk.group_block_ids]
            end = chunk.start_pos + chunk.num_tokens
            final = cdiv(end, bs) if end >= job.num_prompt_tokens else end // bs
            units = job.unsent(job.num_blocks_sent, final)
            job.num_blocks_sent = final
            if units:
                work.append((job, units))
        if not work:
            return None
        layout, per_write = self._layout, self._layers_per_write
        done: list[int] = []  # finished layers not yet written

        def on_layer_done(layer: int) -> None:
            done.append(layer)
            if len(done) < per_write and layer != layout.num_layers - 1:
                return
            for job, units in work:
                for g, block_ids, slots in units:
                    layers = [i for i in done if layout.group_of(i) == g and layout.layers[i].stored]
                    if layers:
                        job.group.start(TransferOp.WRITE, block_plan(layout, job.group.link.cache_region, block_ids,
                                                                      job.slots.space, slots, layers, g))
                job.group.poll()  # progress the earlier layers' transfers (backends without their own thread)
            done.clear()

        return on_layer_done

    def finish(self, request_id: str, tables: list[list[int]], result: HandoffResult,
               hidden: torch.Tensor | None) -> None:
        """The first token is out: send what is left (everything, after_prefill) and the hidden states.
        `tables`: the request's block table in each layer group."""
        job = self._jobs[request_id]
        job.tables = tables
        num_blocks = cdiv(job.num_prompt_tokens, self._layout.block_size)
        if job.num_blocks_sent < num_blocks:
            for g, ids, slots in job.unsent(job.num_blocks_sent, num_blocks):
                job.group.start(TransferOp.WRITE, block_plan(self._layout, job.group.link.cache_region, ids,
                                                              job.slots.space, slots, range(self._layout.num_layers), g))
            job.num_blocks_sent = num_blocks
        if hidden is not None and hidden.numel():
            staged = hidden.to(self._layout.hidden_dtype).contiguous()  # [num_hidden_tokens, hidden_width]
            region = job.group.register(staged)
            job.group.start(TransferOp.WRITE, slots_plan(region, 0, staged.numel() * staged.element_size(),
                                                         job.slots.space, job.slots.hidden_slots))
        job.result = result

    @property
    def num_finishing(self) -> int:
        """Jobs whose prompt is computed and every write posted: waiting only for those writes to end."""
        return sum(job.result is not None for job in self._jobs.values())

    def any_over(self) -> bool:
        """Whether a finishing job's transfers are over (the next poll reports it)."""
        return any(job.result is not None and job.group.poll() is not TransferState.PENDING
                   for job in self._jobs.values())

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
