from __future__ import annotations

import pytest

from shared.errors import UnavailableError
from shared.registry import Load, pick_decode, pick_prefill
from shared.registry.picker import pick_kv_transfer
from tests.helpers.registry_factories import decode_load, make_instance


def test_pick_decode_prefers_fewest_requests_over_free_kv() -> None:
    # free KV first once sent a burst 9:1 while load reports lagged: the request count decides now
    busy_but_roomy = make_instance("a", load=decode_load(free=95, total=100, running=3))
    idle_but_fuller = make_instance("b", load=decode_load(free=60, total=100, running=1))
    assert pick_decode([busy_but_roomy, idle_but_fuller]).instance_id == "b"


def test_pick_decode_adds_inflight_to_reported_load() -> None:
    a = make_instance("a", load=decode_load(free=100, running=1))
    b = make_instance("b", load=decode_load(free=100, running=2))
    assert pick_decode([a, b]).instance_id == "a"
    assert pick_decode([a, b], inflight={"a": 2}).instance_id == "b"  # 1 + 2 in flight > 2


def test_pick_decode_burst_between_reports_alternates() -> None:
    """Ten picks against reports that never update: the in-flight counts alone spread them 5:5."""
    instances = [make_instance("d0", load=decode_load(free=99)), make_instance("d1", load=decode_load(free=100))]
    inflight: dict[str, int] = {}
    for _ in range(10):
        chosen = pick_decode(instances, inflight=inflight).instance_id
        inflight[chosen] = inflight.get(chosen, 0) + 1
    assert inflight == {"d0": 5, "d1": 5}


def test_pick_decode_breaks_request_ties_by_free_fraction_then_id() -> None:
    fuller = make_instance("a", load=decode_load(free=40, running=1))
    roomier = make_instance("b", load=decode_load(free=50, running=0, waiting=1))
    assert pick_decode([fuller, roomier]).instance_id == "b"
    small_but_empty = make_instance("c", load=decode_load(free=90, total=100))
    big_but_fuller = make_instance("d", load=decode_load(free=500, total=1000))  # more blocks, smaller fraction
    assert pick_decode([big_but_fuller, small_but_empty]).instance_id == "c"
    twin_x = make_instance("x", load=decode_load(free=50))
    twin_y = make_instance("y", load=decode_load(free=50))
    assert pick_decode([twin_y, twin_x]).instance_id == "x"
    assert pick_decode([twin_x, twin_y]).instance_id == "x"


def test_pick_decode_ranks_instance_without_kv_report_last_among_equals() -> None:
    unknown = make_instance("a", load=Load())  # total 0: has not reported its cache yet
    nearly_full = make_instance("b", load=decode_load(free=1, total=100))
    assert pick_decode([unknown, nearly_full]).instance_id == "b"


def test_pick_decode_skips_draining_and_excluded() -> None:
    best_but_draining = make_instance("a", load=decode_load(free=100), draining=True)
    tried = make_instance("b", load=decode_load(free=90))
    left = make_instance("c", load=decode_load(free=10))
    assert pick_decode([best_but_draining, tried, left], exclude={"b"}).instance_id == "c"


@pytest.mark.parametrize("draining", [True, False])
def test_pick_decode_raises_unavailable_when_none(draining: bool) -> None:
    with pytest.raises(UnavailableError, match="no decode instance"):
        pick_decode([make_instance("a", draining=True)] if draining else [])


def test_pick_prefill_prefers_shortest_queue_counting_running() -> None:
    a = make_instance("a", "prefill", load=Load(num_running=2, num_waiting=2))
    b = make_instance("b", "prefill", load=Load(num_running=0, num_waiting=3))
    c = make_instance("c", "prefill", load=Load(num_running=3, num_waiting=0))
    assert pick_prefill([a, b, c], exclude=set()).instance_id == "b"
    assert pick_prefill([c, a]).instance_id == "c"  # 3 < 4
    assert pick_prefill([c, a], inflight={"c": 2}).instance_id == "a"  # 3 + 2 in flight > 4


def test_pick_prefill_tie_break_is_deterministic() -> None:
    instances = [make_instance(i, "prefill", load=Load(num_waiting=1)) for i in ("p2", "p0", "p1")]
    assert pick_prefill(instances, exclude=set()).instance_id == "p0"
    assert pick_prefill(list(reversed(instances)), exclude=set()).instance_id == "p0"


def test_pick_prefill_retry_walks_every_instance_then_gives_up() -> None:
    instances = [
        make_instance("p0", "prefill", load=Load(num_waiting=0)),
        make_instance("p1", "prefill", load=Load(num_waiting=5)),
        make_instance("p2", "prefill", load=Load(num_waiting=1)),
        make_instance("p3", "prefill", draining=True),
    ]
    tried: set[str] = set()
    order = []
    for _ in range(3):
        chosen = pick_prefill(instances, exclude=tried)
        order.append(chosen.instance_id)
        tried.add(chosen.instance_id)
    assert order == ["p0", "p2", "p1"]
    with pytest.raises(UnavailableError, match=r"1 draining, 3 already tried"):
        pick_prefill(instances, exclude=tried)


def test_load_kv_free_fraction_is_clamped() -> None:
    assert Load(num_kv_blocks_total=10, num_kv_blocks_free=5).kv_free_fraction == 0.5
    assert Load(num_kv_blocks_total=10, num_kv_blocks_free=12).kv_free_fraction == 1.0
    assert Load().kv_free_fraction == 0.0


def test_pick_kv_transfer_keeps_a_prompt_prefix_on_one_instance() -> None:
    pool = [make_instance(name, "kv_transfer") for name in ("k0", "k1", "k2", "k3")]
    turn1 = list(range(100, 140))
    turn2 = turn1 + list(range(7, 60))  # the next turn of the same chat
    assert pick_kv_transfer(pool, turn1).instance_id == pick_kv_transfer(list(reversed(pool)), turn2).instance_id
    chosen = {pick_kv_transfer(pool, [i] * 40).instance_id for i in range(64)}
    assert len(chosen) == 4  # different prefixes spread over every instance


def test_pick_kv_transfer_leaves_a_much_busier_instance_and_skips_draining() -> None:
    prompt = list(range(32))
    pool = [make_instance(name, "kv_transfer") for name in ("k0", "k1")]
    preferred = pick_kv_transfer(pool, prompt).instance_id
    busy = [make_instance(i.instance_id, "kv_transfer", load=Load(num_running=20 if i.instance_id == preferred
                                                                  else 0)) for i in pool]
    assert pick_kv_transfer(busy, prompt).instance_id != preferred
    draining = [make_instance(i.instance_id, "kv_transfer", draining=i.instance_id == preferred) for i in pool]
    assert pick_kv_transfer(draining, prompt).instance_id != preferred
    with pytest.raises(UnavailableError):
        pick_kv_transfer([], prompt)
