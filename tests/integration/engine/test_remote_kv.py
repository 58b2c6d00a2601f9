"""The engine's kv_transfer path on a tiny model, against real slots: a registered buffer and a TCP agent
standing in for kv_transfer's slab (the services tests run the real kv_transfer).

prefill engine ──WRITE (layer by layer)──► slab ──READ──► decode engine: same tokens as colocated;
a handoff from another model or shape is refused with a clear error; aborts free everything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from shared.engine import kv_push
from shared.engine.block_pool import hash_prefix_blocks
from shared.engine.engine import LLMEngine
from shared.engine.kv_link import TransferGroup
from shared.engine.kv_push import PushOutcome
from shared.engine.request import SamplingParams
from shared.errors import InvalidRequestError
from shared.kv.layout import cdiv
from shared.kv.remote import (
    AgentAddress,
    ClaimedHandoff,
    HandoffResult,
    HandoffSlots,
    HandoffSpec,
    SlotSpace,
    slot_nbytes_for,
)
from shared.transport import host_buffer, make_transport
from tests.helpers.models import tiny_engine, tiny_loaded

NUM_SLOTS = 64


@pytest.fixture(scope="module")
def slab():  # type: ignore[no-untyped-def]
    """A TCP agent with a registered slab: what kv_transfer's memory looks like to the engines."""
    loaded, _ = tiny_loaded()
    probe = tiny_engine(loaded)
    slot_nbytes = slot_nbytes_for(probe.layout)
    agent = make_transport("tcp", "slab", transfer_timeout_s=5.0)
    memory = host_buffer(NUM_SLOTS * slot_nbytes)
    region = agent.register(memory)
    address = AgentAddress("tcp", agent.metadata(), SlotSpace("slab", region.addr, slot_nbytes, NUM_SLOTS))
    yield loaded, address
    agent.close()


def _spec(engine, prompt: list[int], handoff_id: str) -> HandoffSpec:  # type: ignore[no-untyped-def]
    bs = engine.config.block_size
    layout = replace(engine.layout, num_blocks=cdiv(len(prompt), bs))
    hidden = len(prompt) * engine.loaded.spec.hidden_size * layout.itemsize
    return HandoffSpec(handoff_id, handoff_id, engine.loaded.identity, layout, prompt,
                       hash_prefix_blocks(prompt, bs, engine.kv.hash_salt), hidden)


def _slots(spec: HandoffSpec, space: SlotSpace, first_slot: int) -> HandoffSlots:
    num_hidden = cdiv(spec.hidden_nbytes, space.slot_nbytes)
    ids = list(range(first_slot, first_slot + spec.num_blocks + num_hidden))
    return HandoffSlots(space, ids[: spec.num_blocks], [False] * spec.num_blocks, ids[spec.num_blocks:])


def _drain(engine) -> dict[str, list]:  # type: ignore[no-untyped-def]
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@dataclass
class SlotRun:
    results: list[list[int]]  # per prompt: first token (prefill) + decode's tokens
    pushes: list[PushOutcome]
    prefill: LLMEngine
    decode: LLMEngine


def _through_slots(  # type: ignore[no-untyped-def]
    loaded, address, prompts: list[list[int]], params: SamplingParams, prefill_config: dict[str, Any],
    decode_config: dict[str, Any],
) -> SlotRun:
    """Prefill the prompts writing into the slab layer by layer, decode them from it; both engines leak-checked."""
    prefill = tiny_engine(loaded, role="prefill", **prefill_config)
    decode = tiny_engine(loaded, role="decode", **decode_config)
    prefill.enable_remote_kv("layerwise")
    decode.enable_remote_kv()
    specs, first_slot = [], 0
    for i, prompt in enumerate(prompts):
        spec = _spec(prefill, prompt, f"p{i}")
        slots = _slots(spec, address.space, first_slot)
        first_slot += len(slots.block_slots) + len(slots.hidden_slots)
        prefill.add_pushed_request(f"p{i}", prompt, params, address, slots)
        specs.append((spec, slots))
    finals = {rid: outs[-1] for rid, outs in _drain(prefill).items()}
    results, pushes = [], []
    for i, (spec, slots) in enumerate(specs):
        push = finals[f"p{i}"].handoff
        assert isinstance(push, PushOutcome) and push.result is not None, push
        decode.add_pulled_handoff(f"p{i}", params, ClaimedHandoff(spec, push.result, slots), address)
        results.append([push.result.first_token_id])
        pushes.append(push)
    for rid, outs in _drain(decode).items():
        results[int(rid[1:])].extend(t for out in outs for t in out.new_token_ids)
    prefill.check_no_leaks()
    decode.check_no_leaks()
    prefill.remote.close()  # type: ignore[union-attr]
    decode.remote.close()  # type: ignore[union-attr]
    return SlotRun(results, pushes, prefill, decode)


@pytest.mark.parametrize("decode_block_size", [4, 8])
def test_prefill_to_decode_through_slots_equals_colocated(slab, decode_block_size: int,  # type: ignore[no-untyped-def]
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    loaded, address = slab
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i for i in range(23)], [40 + (i * 7) % 50 for i in range(9)]]
    expected = [r.token_ids for r in tiny_engine(loaded).generate(prompts, params)]
    starts = []
    real_start = TransferGroup.start

    def counted(self, *args):  # type: ignore[no-untyped-def]
        starts.append(1)
        return real_start(self, *args)

    monkeypatch.setattr(TransferGroup, "start", counted)
    writes = {}
    # a write per layer, and the tiny model's two layers in one write (the last layer sends what is left)
    for per_write in (1, 2):
        monkeypatch.setattr(kv_push, "LAYERS_PER_WRITE", per_write)
        starts.clear()
        run = _through_slots(loaded, address, prompts, params, {"max_num_batched_tokens": 8},  # chunked: pushes
                             {"block_size": decode_block_size})                             # over steps
        for push, prompt in zip(run.pushes, prompts, strict=True):
            assert push.error is None and push.nbytes > 0
            assert push.result is not None and push.result.num_hidden_tokens == len(prompt)
        assert run.results == expected
        assert run.decode.remote is not None and run.decode.remote.stats.by_direction["pull"].count == 2
        writes[per_write] = len(starts)
    assert writes[1] > writes[2], writes


def test_incompatible_handoffs_are_refused(slab) -> None:  # type: ignore[no-untyped-def]
    loaded, address = slab
    decode = tiny_engine(loaded, role="decode")
    decode.enable_remote_kv()
    spec = _spec(decode, [1, 2, 3, 4, 5], "h")
    slots = _slots(spec, address.space, 0)
    first = HandoffResult(7, None)
    other_model = replace(spec, model="another-model")
    with pytest.raises(InvalidRequestError, match="model another-model"):
        decode.add_pulled_handoff("a", SamplingParams(), ClaimedHandoff(other_model, first, slots), address)
    other_heads = replace(spec, layout=replace(spec.layout, num_kv_heads=spec.layout.num_kv_heads * 2))
    with pytest.raises(InvalidRequestError, match="num_kv_heads"):
        decode.add_pulled_handoff("b", SamplingParams(), ClaimedHandoff(other_heads, first, slots), address)
    other_dtype = replace(spec, layout=replace(spec.layout, dtype=torch.float16))
    with pytest.raises(InvalidRequestError, match="dtype"):
        decode.add_pulled_handoff("c", SamplingParams(), ClaimedHandoff(other_dtype, first, slots), address)
    decode.check_no_leaks()


def test_abort_while_pulling_frees_the_blocks(slab) -> None:  # type: ignore[no-untyped-def]
    loaded, address = slab
    decode = tiny_engine(loaded, role="decode")
    decode.enable_remote_kv()
    prompt = list(range(3, 40))
    spec = _spec(decode, prompt, "h")
    decode.add_pulled_handoff("h", SamplingParams(max_tokens=4), ClaimedHandoff(spec, HandoffResult(7, None),
                                                                                  _slots(spec, address.space, 0)),
                              address)
    assert decode.has_unfinished() and decode.num_free_kv_blocks < decode.num_kv_blocks
    assert decode.abort("h")
    assert not decode.abort("h")  # once
    decode.check_no_leaks()
    decode.remote.close()  # type: ignore[union-attr]


def test_prefill_preempted_mid_push_resends_and_matches_colocated(  # type: ignore[no-untyped-def]
        slab, monkeypatch: pytest.MonkeyPatch) -> None:
    """Too few blocks for both prompts: the second is preempted (its writes restart) while the first's
    finished handoff still holds its blocks, which lasts until the first's writes are over: a race, so
    the pair is run until a preemption happened (every run must match colocated either way). The engine's
    wait for a computed prompt's last writes before the next step is off here: it would settle the race."""
    monkeypatch.setattr("shared.engine.engine._PUSH_SETTLE_S", 0.0)
    loaded, address = slab
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i for i in range(20)], [60 + i for i in range(20)]]
    expected = [r.token_ids for r in tiny_engine(loaded).generate(prompts, params)]
    preemptions = 0
    for _ in range(8):
        run = _through_slots(loaded, address, prompts, params, {  # too small for both prompts at once
            "num_kv_blocks": 8, "max_model_len": 32, "max_num_batched_tokens": 12, "enable_prefix_caching": False,
        }, {})
        assert run.results == expected
        preemptions += run.prefill.scheduler.num_preemptions_total
        if preemptions:
            break
    assert preemptions > 0


def test_a_computed_prompt_is_released_before_the_next_prompt_computes(slab) -> None:  # type: ignore[no-untyped-def]
    """Two pushed prompts, one step each: the first's first token (its writes over) comes out of the engine
    before the step that computes the second, not after it (on a CPU that step is a whole prefill long)."""
    loaded, address = slab
    prefill = tiny_engine(loaded, role="prefill", max_num_batched_tokens=20)
    prefill.enable_remote_kv("layerwise")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first_slot = 0
    for i, prompt in enumerate([[5 + i for i in range(20)], [60 + i for i in range(20)]]):
        slots = _slots(_spec(prefill, prompt, f"p{i}"), address.space, first_slot)
        first_slot += len(slots.block_slots) + len(slots.hidden_slots)
        prefill.add_pushed_request(f"p{i}", prompt, params, address, slots)
    events: list[tuple[str, str]] = []
    schedule = prefill.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        plan = schedule()
        events.extend(("computes", chunk.request_id) for chunk in plan.chunks)
        return plan
    prefill.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    while prefill.has_unfinished():
        events.extend(("released", out.request_id) for out in prefill.step() if out.finished)
    assert events == [("computes", "p0"), ("released", "p0"), ("computes", "p1"), ("released", "p1")], events
    prefill.check_no_leaks()
    prefill.remote.close()  # type: ignore[union-attr]


def test_aux_hidden_layers_travel_after_the_final_hidden_states() -> None:
    """EAGLE-3 style: layers 0 and 2's outputs follow the final hidden states, equal to transformers'."""
    loaded, hf = tiny_loaded(num_hidden_layers=4)
    prompt = [5 + (i * 3) % 40 for i in range(11)]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    plain = tiny_engine(loaded, role="prefill").generate([prompt], params)[0].handoff
    aux = tiny_engine(loaded, role="prefill", aux_hidden_layers=(0, 2)).generate([prompt], params)[0].handoff
    h = loaded.spec.hidden_size
    assert plain is not None and aux is not None
    assert aux.hidden_states.shape == (len(prompt), 3 * h)
    torch.testing.assert_close(aux.hidden_states[:, :h], plain.hidden_states)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states  # [embeddings, layer 0, ...]
    torch.testing.assert_close(aux.hidden_states[:, h:2 * h], ref[1][0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(aux.hidden_states[:, 2 * h:], ref[3][0], atol=2e-4, rtol=2e-4)
    with pytest.raises(Exception, match="aux_hidden_layers"):
        tiny_engine(loaded, role="prefill", aux_hidden_layers=(99,))
