"""Conversions between kv_transfer's protobuf messages and `shared.kv.remote`'s dataclasses.

Whatever comes off the wire is validated here and fails with
`InvalidRequestError`; the servicer and the client call nothing else.
"""

from __future__ import annotations

from proto.baton.v1 import kv_transfer_pb2
from shared.errors import InvalidRequestError
from shared.kv.layout import KVLayout, LayerKV
from shared.kv.remote import AgentAddress, ClaimedHandoff, HandoffResult, HandoffSlots, HandoffSpec, SlotSpace
from shared.wire import dtype_from_name, dtype_name, token_logprobs_from_proto, token_logprobs_to_proto

MAX_HANDOFF_ID_CHARS = 256
MAX_NUM_LAYERS = 4096
MAX_DIM = 1 << 16  # bounds any single dimension a peer can make us size memory by


def layout_to_proto(model: str, layout: KVLayout) -> kv_transfer_pb2.KVLayoutDesc:
    layers = [kv_transfer_pb2.LayerKVDesc(
        num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, num_tensors=g.num_tensors,
        reads_layer=-1 if g.reads_layer is None else g.reads_layer, sliding_window=g.sliding_window or 0,
    ) for g in layout.per_layer]
    return kv_transfer_pb2.KVLayoutDesc(
        model=model, num_layers=layout.num_layers, block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=dtype_name(layout.dtype), layers=layers,
    )


def _check_dims(dims: dict[str, int]) -> None:
    for name, value in dims.items():
        if not 1 <= value <= MAX_DIM or (name == "num_layers" and value > MAX_NUM_LAYERS):
            raise InvalidRequestError(f"layout {name} {value} outside [1, {MAX_DIM}]", param=name)


def _layers_from_proto(desc: kv_transfer_pb2.KVLayoutDesc) -> tuple[LayerKV, ...]:
    if desc.layers and len(desc.layers) != desc.num_layers:
        raise InvalidRequestError(f"layout lists {len(desc.layers)} layers of {desc.num_layers}", param="layers")
    layers = []
    for g in desc.layers:
        _check_dims({"num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim})
        if g.num_tensors not in (1, 2):
            raise InvalidRequestError(f"layer geometry {g} out of range", param="layers")
        layers.append(LayerKV(g.num_kv_heads, g.head_dim, g.num_tensors,
                              None if g.reads_layer < 0 else g.reads_layer, g.sliding_window or None))
    return tuple(layers)


def layout_from_proto(desc: kv_transfer_pb2.KVLayoutDesc, num_blocks: int) -> tuple[str, KVLayout]:
    _check_dims({"num_layers": desc.num_layers, "block_size": desc.block_size, "num_kv_heads": desc.num_kv_heads,
                 "head_dim": desc.head_dim, "num_blocks": num_blocks})
    if not desc.model:
        raise InvalidRequestError("layout names no model", param="model")
    try:
        layout = KVLayout(desc.num_layers, num_blocks, desc.block_size, desc.num_kv_heads, desc.head_dim,
                          dtype_from_name(desc.dtype), _layers_from_proto(desc))
    except ValueError as e:  # a shared layer that reads no earlier stored layer
        raise InvalidRequestError(f"layout: {e}", param="layers") from None
    return desc.model, layout


def _check_handoff_id(handoff_id: str) -> None:
    if not handoff_id or len(handoff_id) > MAX_HANDOFF_ID_CHARS:
        raise InvalidRequestError(f"handoff_id must be 1..{MAX_HANDOFF_ID_CHARS} characters", param="handoff_id")


# --- agent ----------------------------------------------------------------------------------------


def agent_to_proto(address: AgentAddress) -> kv_transfer_pb2.AgentInfo:
    s = address.space
    return kv_transfer_pb2.AgentInfo(name=s.agent_name, kind=address.kind, metadata=address.metadata,
                                     base_addr=s.base_addr, slot_nbytes=s.slot_nbytes, num_slots=s.num_slots,
                                     device_id=s.device_id)


def agent_from_proto(msg: kv_transfer_pb2.AgentInfo) -> AgentAddress:
    if not msg.name or not msg.kind:
        raise InvalidRequestError("agent info without a name or kind")
    space = SlotSpace(msg.name, msg.base_addr, msg.slot_nbytes, msg.num_slots, msg.device_id)
    return AgentAddress(msg.kind, bytes(msg.metadata), space)


# --- Reserve --------------------------------------------------------------------------------------


def reserve_to_proto(spec: HandoffSpec) -> kv_transfer_pb2.ReserveRequest:
    return kv_transfer_pb2.ReserveRequest(
        handoff_id=spec.handoff_id, request_id=spec.request_id, layout=layout_to_proto(spec.model, spec.layout),
        num_blocks=spec.num_blocks, block_hashes=spec.block_hashes, prompt_token_ids=spec.prompt_token_ids,
        hidden_nbytes=spec.hidden_nbytes, lease_timeout_ms=spec.lease_timeout_ms, capability=spec.capability,
    )


def reserve_from_proto(msg: kv_transfer_pb2.ReserveRequest) -> HandoffSpec:
    """A validated spec: the blocks cover exactly the prompt, one hash per full block."""
    _check_handoff_id(msg.handoff_id)
    model, layout = layout_from_proto(msg.layout, msg.num_blocks)
    num_tokens = len(msg.prompt_token_ids)
    if num_tokens == 0 or len(layout.handoff_units(num_tokens)) != msg.num_blocks:
        raise InvalidRequestError(f"handoff {msg.handoff_id}: {msg.num_blocks} blocks of {layout.block_size} "
                                  f"do not cover a prompt of {num_tokens} tokens", param="num_blocks")
    if len(msg.block_hashes) != layout.num_hashed_units(num_tokens):
        raise InvalidRequestError(f"handoff {msg.handoff_id}: {len(msg.block_hashes)} block hashes for "
                                  f"{layout.num_hashed_units(num_tokens)} full blocks", param="block_hashes")
    return HandoffSpec(msg.handoff_id, msg.request_id, model, layout, list(msg.prompt_token_ids),
                       [bytes(h) for h in msg.block_hashes], msg.hidden_nbytes, msg.lease_timeout_ms,
                       capability=msg.capability)


def slots_to_proto(slots: HandoffSlots, address: AgentAddress) -> kv_transfer_pb2.ReserveResponse:
    return kv_transfer_pb2.ReserveResponse(block_slots=slots.block_slots, present=slots.present,
                                           hidden_slots=slots.hidden_slots, agent=agent_to_proto(address),
                                           lease_timeout_ms=int(slots.lease_timeout_s * 1000))


def slots_from_proto(msg: kv_transfer_pb2.ReserveResponse, spec: HandoffSpec) -> tuple[HandoffSlots, AgentAddress]:
    address = agent_from_proto(msg.agent)
    if len(msg.block_slots) != spec.num_blocks or len(msg.present) != spec.num_blocks:
        raise InvalidRequestError(f"handoff {spec.handoff_id}: reserve answered {len(msg.block_slots)} slots "
                                  f"for {spec.num_blocks} blocks")
    slots = HandoffSlots(address.space, list(msg.block_slots), list(msg.present), list(msg.hidden_slots),
                         msg.lease_timeout_ms / 1000)
    _check_slots(slots)
    return slots, address


def _check_slots(slots: HandoffSlots) -> None:
    n = slots.space.num_slots
    if any(not 0 <= s < n for s in (*slots.block_slots, *slots.hidden_slots)):
        raise InvalidRequestError(f"slot ids outside [0, {n})")


# --- Commit ---------------------------------------------------------------------------------------


def commit_to_proto(handoff_id: str, result: HandoffResult, capability: str = "") -> kv_transfer_pb2.CommitRequest:
    msg = kv_transfer_pb2.CommitRequest(
        handoff_id=handoff_id, first_token_id=result.first_token_id, hidden_width=result.hidden_width,
        num_hidden_tokens=result.num_hidden_tokens, capability=capability,
    )
    if result.first_logprobs is not None:
        msg.first_logprobs.CopyFrom(token_logprobs_to_proto(result.first_logprobs))
    return msg


def commit_from_proto(msg: kv_transfer_pb2.CommitRequest) -> tuple[str, HandoffResult]:
    _check_handoff_id(msg.handoff_id)
    if msg.num_hidden_tokens and not 1 <= msg.hidden_width <= MAX_DIM:
        raise InvalidRequestError("hidden states committed without a hidden_width", param="hidden_width")
    logprobs = token_logprobs_from_proto(msg.first_logprobs) if msg.HasField("first_logprobs") else None
    return msg.handoff_id, HandoffResult(msg.first_token_id, logprobs, msg.hidden_width, msg.num_hidden_tokens)


# --- Claim ----------------------------------------------------------------------------------------


def claimed_to_proto(claimed: ClaimedHandoff, address: AgentAddress) -> kv_transfer_pb2.ClaimResponse:
    spec, result, slots = claimed.spec, claimed.result, claimed.slots
    msg = kv_transfer_pb2.ClaimResponse(
        request_id=spec.request_id, layout=layout_to_proto(spec.model, spec.layout),
        prompt_token_ids=spec.prompt_token_ids, block_hashes=spec.block_hashes,
        first_token_id=result.first_token_id, block_slots=slots.block_slots, hidden_slots=slots.hidden_slots,
        hidden_width=result.hidden_width, num_hidden_tokens=result.num_hidden_tokens,
        agent=agent_to_proto(address), claim_timeout_ms=claimed.claim_timeout_ms,
    )
    if result.first_logprobs is not None:
        msg.first_logprobs.CopyFrom(token_logprobs_to_proto(result.first_logprobs))
    return msg


def claimed_from_proto(msg: kv_transfer_pb2.ClaimResponse, handoff_id: str) -> tuple[ClaimedHandoff, AgentAddress]:
    num_blocks = len(msg.block_slots)
    model, layout = layout_from_proto(msg.layout, num_blocks)
    address = agent_from_proto(msg.agent)
    spec = HandoffSpec(handoff_id, msg.request_id, model, layout, list(msg.prompt_token_ids),
                       [bytes(h) for h in msg.block_hashes], 0)
    if not spec.prompt_token_ids or len(layout.handoff_units(len(spec.prompt_token_ids))) != num_blocks:
        raise InvalidRequestError(f"handoff {handoff_id}: claim describes {num_blocks} blocks for "
                                  f"{len(spec.prompt_token_ids)} prompt tokens")
    logprobs = token_logprobs_from_proto(msg.first_logprobs) if msg.HasField("first_logprobs") else None
    result = HandoffResult(msg.first_token_id, logprobs, msg.hidden_width, msg.num_hidden_tokens)
    slots = HandoffSlots(address.space, list(msg.block_slots), [False] * num_blocks, list(msg.hidden_slots))
    _check_slots(slots)
    claimed = ClaimedHandoff(spec, result, slots, msg.claim_timeout_ms)
    if claimed.hidden_nbytes > len(slots.hidden_slots) * address.space.slot_nbytes:
        raise InvalidRequestError(f"handoff {handoff_id}: hidden states do not fit their slots")
    return claimed, address
