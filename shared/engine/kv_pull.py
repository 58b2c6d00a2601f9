"""Pulls from kv_transfer's slots into this engine's blocks: decode's admission, prefill's prefix import.

    start(request_id, address, source blocks, local block ids) ─► READ ─► poll: DONE | FAILED ─► PullOutcome

Only the blocks the caller lacks are asked for (decode skips its own prefix
cache hits; prefill imports only the pool's prefix it does not hold). When
the two block sizes differ, the slots are read into a staging buffer and
re-cut token by token into local blocks. Hidden states, when there are any,
land in a fresh tensor. The caller holds the local blocks until the pull is
over; `abort` stops it before the blocks can be freed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shared.engine.kv_link import KVAgents, RequestTransfers, TransferGroup
from shared.kv.layout import KVLayout, cdiv
from shared.kv.remote import (
    AgentAddress,
    HandoffSlots,
    block_plan,
    slot_nbytes_for,
    slots_plan,
    whole_slots_plan,
)
from shared.transport.base import TransferOp, TransferState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullSource:
    """What to read: blocks of `layout` (its block size) in `slots`, and optionally hidden states."""

    layout: KVLayout  # the remote block format; num_blocks = len(slots.block_slots)
    slots: HandoffSlots
    num_tokens: int  # tokens to read (from the start of the prompt)
    hidden_shape: tuple[int, int] = (0, 0)  # [num_hidden_tokens, hidden_width]
    handoff_tokens: int = 0  # the prompt the slots' units were cut for (KVLayout.handoff_units); 0 = num_tokens

    def units(self) -> dict[tuple[int, int], int]:
        """(layer group, block index) -> its unit (slot index) in the handoff."""
        return {u: i for i, u in enumerate(self.layout.handoff_units(self.handoff_tokens or self.num_tokens))}


@dataclass
class PullOutcome:
    hidden_states: torch.Tensor | None  # [num_hidden_tokens, hidden_width], when asked for
    error: str | None
    nbytes: int
    seconds: float


@dataclass
class _PullJob:
    group: TransferGroup
    source: PullSource
    tables: list[list[int]]  # local table in each layer group, covering the source tokens
    first_token: int  # tokens before this are already local
    staging: torch.Tensor | None  # block-size conversion: [num_blocks, slot elements]
    hidden: torch.Tensor | None


class KVPuller(RequestTransfers[_PullJob]):
    def __init__(self, agents: KVAgents, layout: KVLayout, kv_cache: torch.Tensor) -> None:
        super().__init__()
        self._agents = agents
        self._layout = layout
        self._kv_cache = kv_cache  # KVLayout.shape

    def check_compatible(self, remote: KVLayout) -> None:
        """Raises ValueError naming each difference that no conversion can bridge."""
        mine = self._layout
        problems = [f"{f} {getattr(remote, f)} != {getattr(mine, f)}"
                    for f in ("num_layers", "num_kv_heads", "head_dim", "dtype")
                    if getattr(remote, f) != getattr(mine, f)]
        if not problems and remote.describe() != mine.describe():
            problems.append(f"layer geometry {remote.describe()} != {mine.describe()}")
        if len(mine.groups) > 1 and remote.block_size != mine.block_size:  # units are blocks of each group
            problems.append(f"block_size {remote.block_size} != {mine.block_size} (layer groups convert none)")
        if problems:
            raise ValueError("; ".join(problems))

    def start(self, request_id: str, address: AgentAddress, source: PullSource, tables: list[list[int]],
              first_token: int) -> None:
        """Read tokens [first_token, source.num_tokens) into `tables` (the request's local table in each layer
        group; a sliding group's only from the block the next query sees)."""
        group = TransferGroup(self._agents.link(address))
        job = _PullJob(group, source, tables, first_token, None, None)
        self._jobs[request_id] = job
        remote, bs = source.layout, self._layout.block_size
        layers = range(self._layout.num_layers)
        if remote.block_size == bs:
            units, hi = source.units(), cdiv(source.num_tokens, bs)
            for g, kv_group in enumerate(self._layout.groups):
                lo = max(first_token // bs, kv_group.first_kept_block(source.num_tokens, bs))
                ids = [tables[g][i] for i in range(lo, hi)]
                slots = [source.slots.block_slots[units[(g, i)]] for i in range(lo, hi)]
                group.start(TransferOp.READ, block_plan(self._layout, group.link.cache_region, ids,
                                                        source.slots.space, slots, layers, g))
        else:
            lo = first_token // remote.block_size
            slots = source.slots.block_slots[lo:cdiv(source.num_tokens, remote.block_size)]
            # [num_blocks, slot elements]: the slot layout (each block's every stored layer)
            job.staging = torch.empty((len(slots), remote.slot_nbytes // remote.itemsize), dtype=remote.dtype)
            region = group.register(job.staging)
            group.start(TransferOp.READ, whole_slots_plan(region, slot_nbytes_for(remote), source.slots.space, slots))
        rows, width = source.hidden_shape
        if rows:
            job.hidden = torch.empty((rows, width), dtype=self._layout.hidden_dtype)
            region = group.register(job.hidden)
            nbytes = job.hidden.numel() * job.hidden.element_size()
            group.start(TransferOp.READ, slots_plan(region, 0, nbytes, source.slots.space, source.slots.hidden_slots))

    def poll(self) -> dict[str, PullOutcome]:
        """Pulls that are over, by request id (each reported once); converted blocks are in place."""
        over: dict[str, PullOutcome] = {}
        for request_id, job in list(self._jobs.items()):
            state = job.group.poll()
            if state is TransferState.PENDING:
                continue
            del self._jobs[request_id]
            job.group.close()
            if state is TransferState.DONE and job.staging is not None:
                self._scatter(job)
            error = job.group.error if state is TransferState.FAILED else None
            if error:
                logger.warning("request %s: KV pull failed: %s", request_id, error)
            over[request_id] = PullOutcome(None if error else job.hidden, error, job.group.nbytes, job.group.seconds)
        return over

    def _scatter(self, job: _PullJob) -> None:
        """Re-cut staged remote blocks into local blocks, token by token, from `first_token` on."""
        assert job.staging is not None
        remote, bs = job.source.layout, self._layout.block_size
        base = (job.first_token // remote.block_size) * remote.block_size  # token of staging block 0
        positions = torch.arange(job.first_token, job.source.num_tokens)
        table = torch.tensor(job.tables[0], dtype=torch.long)
        blocks, offsets = table[positions // bs], positions % bs
        for layer in self._layout.stored_layers:
            # [T, tokens, heads, dim] from [num_blocks, T, remote block, heads, dim]
            staged = remote.slot_view(job.staging, layer)
            tokens = staged.permute(1, 0, 2, 3, 4).reshape(staged.shape[1], -1, *staged.shape[3:])
            local = self._layout.layer_blocks(self._kv_cache, layer)  # [num_blocks, T, block_size, heads, dim]
            # local[blocks, :, offsets] is [tokens, T, heads, dim]
            local[blocks, :, offsets] = tokens[:, positions - base].transpose(0, 1).to(local.device)
