"""KV blocks held in kv_transfer's slots: what a handoff is, and the descriptors that move it.

kv_transfer registers one host buffer with its transport agent and cuts it
into equal slots. A slot holds one handoff unit (KVLayout.handoff_units: a block
of one layer group, every stored layer of the group, layer-major; with one group,
a block of every layer), so that one (layer, block) pair is one contiguous span
in both places::

    engine cache  layer l: [block_id, T_l, block_size, H_l, D_l]     (KVLayout; block ids per layer group)
    store slot    one unit: a block of one group, its stored layers  at base + slot * slot_nbytes
                  in order (layer l at KVLayout.slot_offset(l); KV-shared layers take no room)

Hidden states ([num_tokens, hidden_width] in `KVLayout.hidden_dtype`) fill a list of
slots as one byte string cut at slot boundaries.

A handoff, seen from both ends::

    prefill: Reserve(HandoffSpec) ─► HandoffSlots ─► WRITE layer by layer ─► Commit(HandoffResult)
    decode:  Claim ─► ClaimedHandoff (spec + result + slots) ─► READ missing blocks ─► Release
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.engine.request import TokenLogprobs
from shared.kv.layout import KVLayout, cdiv
from shared.transport.base import Descriptor, MemoryRegion


def layout_key(model: str, layout: KVLayout) -> str:
    """Names a block format: prefix-pool entries only match within one key."""
    return f"{model}|{str(layout.dtype).removeprefix('torch.')}|bs{layout.block_size}|{layout.describe()}"


def slot_nbytes_for(layout: KVLayout) -> int:
    """Bytes one slot needs to hold one block of every layer of `layout`."""
    return layout.slot_nbytes


@dataclass(frozen=True)
class SlotSpace:
    """Where a kv_transfer instance's slots live: its agent and their geometry."""

    agent_name: str
    base_addr: int
    slot_nbytes: int
    num_slots: int
    device_id: int = 0

    def span(self, slot: int, offset: int, nbytes: int) -> Descriptor:
        assert 0 <= slot < self.num_slots and 0 <= offset and offset + nbytes <= self.slot_nbytes, (
            slot, offset, nbytes)
        return Descriptor(self.base_addr + slot * self.slot_nbytes + offset, nbytes, self.device_id)


@dataclass(frozen=True)
class AgentAddress:
    """A kv_transfer agent as a peer sees it: how to add it, and where its slots are."""

    kind: str
    metadata: bytes
    space: SlotSpace


@dataclass(frozen=True)
class HandoffSpec:
    """What prefill announces at Reserve: the request, its block format and its full-block hashes."""

    handoff_id: str
    request_id: str
    model: str
    layout: KVLayout  # num_blocks = blocks of this handoff (cdiv(prompt tokens, block_size))
    prompt_token_ids: list[int]
    block_hashes: list[bytes]  # chained hash of each FULL prompt block (the last, partial one has none)
    hidden_nbytes: int  # room to reserve for hidden states (0 = none)
    lease_timeout_ms: int = 0  # 0 = the store's default
    # the router's random secret for this handoff: every later call on it must name it (never logged)
    capability: str = field(default="", repr=False)

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def key(self) -> str:
        return layout_key(self.model, self.layout)


@dataclass(frozen=True)
class HandoffSlots:
    """Where a reserved handoff goes: a slot per block (hits already hold their data) and hidden slots."""

    space: SlotSpace
    block_slots: list[int]
    present: list[bool]  # present[i]: block i is a prefix-pool hit, nobody needs to write it
    hidden_slots: list[int]
    lease_timeout_s: float = 0.0  # the writer renews within this while it is still writing

    @property
    def num_leading_hits(self) -> int:
        """Blocks at the start that the pool already holds: a prefix nobody has to compute."""
        n = 0
        while n < len(self.present) and self.present[n]:
            n += 1
        return n


@dataclass(frozen=True)
class HandoffResult:
    """What prefill adds at Commit: the first token and how much hidden state it wrote."""

    first_token_id: int
    first_logprobs: TokenLogprobs | None
    hidden_width: int = 0
    num_hidden_tokens: int = 0  # rows written: the prompt's LAST positions that prefill computed


@dataclass(frozen=True)
class ClaimedHandoff:
    """What decode gets from Claim: everything it needs to pull the KV."""

    spec: HandoffSpec
    result: HandoffResult
    slots: HandoffSlots
    claim_timeout_ms: int = 0

    @property
    def hidden_nbytes(self) -> int:
        r = self.result
        return r.num_hidden_tokens * r.hidden_width * self.spec.layout.hidden_dtype.itemsize


@dataclass
class TransferPlan:
    """Paired local and remote descriptors of one transfer."""

    local: list[Descriptor] = field(default_factory=list)
    remote: list[Descriptor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.local)

    def __len__(self) -> int:
        return len(self.local)


def block_plan(
    layout: KVLayout, region: MemoryRegion, block_ids: Sequence[int], space: SlotSpace, slots: Sequence[int],
    layers: Iterable[int], group: int = 0,
) -> TransferPlan:
    """Descriptors of `group`'s `block_ids` in the local cache (`region`, `layout`) paired with `slots`, per
    layer of that group among `layers` (KV-shared layers have nothing to move)."""
    assert len(block_ids) == len(slots), (len(block_ids), len(slots))
    plan = TransferPlan()
    for layer in layers:
        nbytes, slot_offset = layout.layer_block_nbytes(layer), layout.slot_offset(layer)
        if not nbytes or layout.group_of(layer) != group:
            continue
        for block_id, slot in zip(block_ids, slots, strict=True):
            plan.local.append(region.descriptor(layout.block_range(layer, block_id).offset, nbytes))
            plan.remote.append(space.span(slot, slot_offset, nbytes))
    return plan


def slots_plan(
    region: MemoryRegion, offset: int, nbytes: int, space: SlotSpace, slots: Sequence[int]
) -> TransferPlan:
    """`nbytes` of local memory at `offset` in `region`, laid across `slots` in order."""
    if cdiv(nbytes, space.slot_nbytes) > len(slots):
        raise ValueError(f"{nbytes} bytes do not fit {len(slots)} slots of {space.slot_nbytes}")
    plan = TransferPlan()
    done = 0
    for slot in slots:
        if done >= nbytes:
            break
        n = min(space.slot_nbytes, nbytes - done)
        plan.local.append(region.descriptor(offset + done, n))
        plan.remote.append(space.span(slot, 0, n))
        done += n
    return plan


def whole_slots_plan(region: MemoryRegion, block_nbytes: int, space: SlotSpace, slots: Sequence[int]) -> TransferPlan:
    """The first `block_nbytes` of each slot (one block, every layer) to consecutive local spans."""
    plan = TransferPlan()
    for i, slot in enumerate(slots):
        plan.local.append(region.descriptor(i * block_nbytes, block_nbytes))
        plan.remote.append(space.span(slot, 0, block_nbytes))
    return plan


def usable_pool_prefix(layout: KVLayout, present: Sequence[bool], num_tokens: int, limit: int) -> int:
    """How many leading blocks of a handoff of `num_tokens` a prefill may read from the pool instead of computing
    (at most `limit`): group 0's blocks present from the start, with, in each sliding group, every block the
    next query after them sees also present (among the handoff's units)."""
    units = {u: i for i, u in enumerate(layout.handoff_units(num_tokens))}
    leading = 0
    while leading < limit and present[units[(0, leading)]]:
        leading += 1
    bs = layout.block_size

    def window_present(n: int) -> bool:
        return all((g, i) in units and present[units[(g, i)]] for g, group in enumerate(layout.groups[1:], 1)
                   for i in range(group.first_kept_block(n * bs, bs), n))

    return next((n for n in range(leading, 0, -1) if window_present(n)), 0)


def unit_hashes(layout: KVLayout, block_hashes: Sequence[bytes], num_tokens: int) -> list[bytes]:
    """The prefix-pool names of a prompt's hashed units (KVLayout.handoff_units), from its full blocks' chained
    hashes: group 0's units are named by the block hash itself, a sliding group's by the hash and the group."""
    units = layout.handoff_units(num_tokens)[: layout.num_hashed_units(num_tokens)]
    return [block_hashes[i] if g == 0 else hashlib.blake2b(b"group%d:" % g + block_hashes[i], digest_size=16).digest()
            for g, i in units]
