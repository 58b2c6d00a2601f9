"""The simulator against cases worked out by hand: one request, a queue of equal jobs, M/D/1, contention."""

from __future__ import annotations

import random

import pytest

from shared.planner import simulator
from shared.planner.metrics import SLO, summarize, tpot_s, ttft_s
from shared.planner.sim_engine import Host
from shared.planner.simulator import Shape, SimOptions, simulate
from shared.planner.workload import TraceRequest
from shared.registry.cost_model import CostModel
from tests.unit.planner.factories import make_profile


@pytest.fixture(autouse=True)
def _no_corun_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases here are worked out by hand with engines that do not slow each other's steps down through
    the memory bus; the test of that effect sets its own SimOptions.corun_speed."""
    monkeypatch.setattr(simulator, "CORUN_SPEED", {})


def test_one_request_colocated() -> None:
    profile = make_profile(prefill=(0.01, 0.001, 0.0), decode=(0.02, 0.005, 0.0))
    [r] = simulate(profile, Shape(0, 1, colocated=True), [TraceRequest(1.0, 100, 5)])
    assert ttft_s(r) == pytest.approx(0.01 + 0.1)  # one step of 100 prompt tokens
    assert tpot_s(r) == pytest.approx(0.025)  # each later token: a decode step of batch 1 (0.02 + 0.005)
    assert r.token_times_s[-1] == pytest.approx(1.0 + 0.11 + 4 * 0.025)


def test_one_request_disaggregated_pays_push_and_pull() -> None:
    profile = make_profile(push=(0.003, 1e-6), pull=(0.002, 2e-6), kv_bytes_per_token=100)
    [r] = simulate(profile, Shape(1, 1), [TraceRequest(0.0, 100, 3)])
    push, pull = 0.003 + 1e-6 * 10_000, 0.002 + 2e-6 * 10_000
    assert ttft_s(r) == pytest.approx(0.11 + push)  # the reply waits for the commit
    assert r.pulled
    assert r.token_times_s[1] - r.token_times_s[0] == pytest.approx(pull + 0.025)
    assert tpot_s(r) == pytest.approx((pull + 2 * 0.025) / 2)


def test_on_one_host_the_push_runs_in_the_prefill_step_and_a_queued_prompt_waits_for_it() -> None:
    """The services push a chunk's KV layer by layer as they compute it, on the same cores: on a host, the
    push is part of the prefill step (the handoff after it is the pull alone), so a second prompt waits for
    the first one's push as well as its compute. Machines of their own (or layerwise_push off): the push
    after the step, beside the next one."""
    profile = make_profile(prefill=(0.0, 0.001, 0.0), push=(0.003, 1e-6), pull=(0.002, 2e-6), kv_bytes_per_token=100)
    push, pull = 0.003 + 1e-6 * 10_000, 0.002 + 2e-6 * 10_000  # 100 tokens' KV: 13 ms and 22 ms
    trace = [TraceRequest(0.0, 100, 1), TraceRequest(0.001, 100, 1)]
    fixed = SimOptions(cores=2, core_share=False, policy="round_robin")
    a, b = simulate(profile, Shape(1, 1), trace, fixed)
    assert ttft_s(a) == pytest.approx(0.1 + push)  # its step computes and pushes, then the reply
    assert ttft_s(b) == pytest.approx(2 * (0.1 + push) - 0.001)  # behind a's compute and push
    [one] = simulate(profile, Shape(1, 1), [TraceRequest(0.0, 100, 2)], fixed)
    assert one.token_times_s[1] - one.token_times_s[0] == pytest.approx(pull + 0.025)  # the pull, then a step
    for options in (SimOptions(cores=2, core_share=False, policy="round_robin", layerwise_push=False),
                    SimOptions(policy="round_robin")):  # the push after the step, off the engine's time
        a, b = simulate(profile, Shape(1, 1), trace, options)
        assert ttft_s(a) == pytest.approx(0.1 + push)
        assert ttft_s(b) == pytest.approx(0.2 + push - 0.001)


def test_long_prompt_is_chunked() -> None:
    profile = make_profile(prefill=(0.01, 0.001, 0.0), budget=512)
    [r] = simulate(profile, Shape(0, 1, colocated=True), [TraceRequest(0.0, 1200, 1)])
    assert ttft_s(r) == pytest.approx(2 * (0.01 + 0.512) + (0.01 + 0.176))  # chunks of 512, 512 and 176


def test_queue_of_equal_jobs_waits_in_turn() -> None:
    """Five prompts at once, one per step (the budget is one prompt): the k-th first token after k steps."""
    profile = make_profile(prefill=(0.0, 0.001, 0.0), budget=100)
    trace = [TraceRequest(0.0, 100, 1) for _ in range(5)]
    requests = simulate(profile, Shape(1, 1), trace, SimOptions(policy="round_robin"))
    assert [round(ttft_s(r), 6) for r in requests] == [0.1, 0.2, 0.3, 0.4, 0.5]
    two = simulate(profile, Shape(2, 1), trace, SimOptions(policy="round_robin"))
    assert [round(ttft_s(r), 6) for r in two] == [0.1, 0.1, 0.2, 0.2, 0.3]


def test_md1_queue_matches_pollaczek_khinchine() -> None:
    """Poisson arrivals, deterministic service S, one server: mean wait = rho S / (2 (1 - rho))."""
    service_s, rate = 0.1, 6.0  # rho 0.6
    profile = make_profile(prefill=(0.0, service_s / 100, 0.0), budget=100)
    rng = random.Random(1)
    now, trace = 0.0, []
    for _ in range(20_000):
        trace.append(TraceRequest(now, 100, 1))
        now += rng.expovariate(rate)
    requests = simulate(profile, Shape(0, 1, colocated=True), trace)
    rho = rate * service_s
    expected = service_s + rho * service_s / (2 * (1 - rho))
    mean = sum(ttft_s(r) for r in requests) / len(requests)
    assert mean == pytest.approx(expected, rel=0.05)


def test_continuous_batching_shares_decode_steps() -> None:
    """The second prompt joins the first's decode step as a chunk, then both decode in one batch."""
    profile = make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.02, 0.005, 0.0))
    a, b = simulate(profile, Shape(0, 1, colocated=True), [TraceRequest(0.0, 50, 4), TraceRequest(0.0, 50, 4)])
    # a's prompt alone (0.05); a decodes while b's prompt runs: one step of 51 tokens (0.051); then
    # batch-2 steps (0.02 + 2 x 0.005); b's last token in a batch-1 step (0.025)
    assert a.token_times_s == pytest.approx([0.05, 0.101, 0.131, 0.161])
    assert b.token_times_s == pytest.approx([0.101, 0.131, 0.161, 0.186])


def test_shared_cores_slow_busy_engines() -> None:
    """Two 1-thread engines with work on a 1-core host: each step takes twice as long."""
    profile = make_profile(prefill=(0.0, 0.001, 0.0))
    trace = [TraceRequest(0.0, 100, 1), TraceRequest(0.0, 100, 1)]
    alone = simulate(profile, Shape(0, 2, colocated=True), trace, SimOptions(policy="round_robin"))
    shared = simulate(profile, Shape(0, 2, colocated=True), trace,
                      SimOptions(policy="round_robin", cores=1, threads_per_engine=1))
    assert [ttft_s(r) for r in alone] == pytest.approx([0.1, 0.1])
    assert [ttft_s(r) for r in shared] == pytest.approx([0.2, 0.2])


def test_prefix_pool_saves_compute_for_a_later_turn() -> None:
    profile = make_profile(prefill=(0.0, 0.001, 0.0))
    trace = [TraceRequest(0.0, 320, 1, "s1", 0), TraceRequest(5.0, 400, 1, "s1", 320)]
    first, second = simulate(profile, Shape(2, 1), trace, SimOptions(policy="round_robin"))
    assert ttft_s(first) == pytest.approx(0.32)
    assert ttft_s(second) == pytest.approx(0.08)  # on the other prefill: 320 tokens from the pool


def test_summary_counts_goodput() -> None:
    profile = make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.02, 0.0, 0.0), budget=100)
    trace = [TraceRequest(0.0, 100, 1) for _ in range(4)]
    summary = summarize(simulate(profile, Shape(0, 1, colocated=True), trace), SLO(ttft_s=0.25, tpot_s=1.0))
    assert summary["slo_attainment"] == 0.5  # TTFTs 0.1, 0.2 meet it; 0.3, 0.4 do not
    assert summary["goodput_req_s"] == pytest.approx(2 / 0.4)  # 2 met over the run's 0.4 s
    assert summary["p50_ttft_ms"] == pytest.approx(250.0)


def test_local_prefill_skips_the_handoff_for_short_prompts() -> None:
    """The router's conditional disaggregation: a prompt its decode instance lacks at most N tokens of is
    computed there (no push, no pull); a longer one goes through prefill and the handoff."""
    from shared.planner.simulator import Fleet

    profile = make_profile(prefill=(0.0, 0.001, 0.0), push=(0.01, 0.0), pull=(0.02, 0.0))
    short, long = simulate(profile, Shape(1, 1), [TraceRequest(0.0, 100, 3), TraceRequest(10.0, 500, 3)],
                           SimOptions(local_prefill_max_tokens=200))
    assert not short.pulled and ttft_s(short) == pytest.approx(0.1)  # no push before its first token
    assert long.pulled and ttft_s(long) == pytest.approx(0.5 + 0.01)
    import simpy

    fleet = Fleet(simpy.Environment(), profile, Shape(1, 1), SimOptions(local_prefill_max_tokens=-1))
    assert fleet._local_threshold() == CostModel().break_even_tokens(16)  # the router's own coefficients


def test_lent_cores_run_an_engine_alone_on_every_core_and_busy_ones_on_their_share() -> None:
    """`baton up`'s core share (shared/engine/core_share.py): on a 2-core host a prefill and a decode take
    both cores while the other has no work, and one each while both have."""
    from shared.planner.profile import EngineCurves

    profile = make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.02, 0.0, 0.0))
    profile.engines[2] = EngineCurves(prefill_fit=[0.0, 0.0005, 0.0], decode_fit=[0.01, 0.0, 0.0])  # 2x faster
    one = [TraceRequest(0.0, 100, 3)]
    [lent] = simulate(profile, Shape(1, 1), one, SimOptions(cores=2))
    [fixed] = simulate(profile, Shape(1, 1), one, SimOptions(cores=2, core_share=False))
    assert ttft_s(lent) == pytest.approx(0.05) and tpot_s(lent) == pytest.approx(0.01)  # both cores each phase
    assert ttft_s(fixed) == pytest.approx(0.1) and tpot_s(fixed) == pytest.approx(0.02)  # one core each
    # a second prompt arrives while the first decodes: both engines busy, one core each, no contention
    a, b = simulate(profile, Shape(1, 1), [TraceRequest(0.0, 100, 20), TraceRequest(0.06, 100, 1)],
                    SimOptions(cores=2))
    assert ttft_s(b) == pytest.approx(0.1)  # prefilled on its share while the decode works
    assert a.token_times_s[2] - a.token_times_s[1] == pytest.approx(0.02)  # decode on one core meanwhile
    assert a.token_times_s[-1] - a.token_times_s[-2] == pytest.approx(0.01)  # both cores again at the end


@pytest.mark.parametrize("prompt_tokens, refits", [(200, True), (60, False)])
def test_a_long_step_on_lent_cores_gives_one_back_when_the_decode_gets_work(prompt_tokens: int,
                                                                          refits: bool) -> None:
    """As the engine reads its share between a long step's layers: B's prefill starts on both cores while the
    decode waits on A's pull, and once A decodes it goes on at its share of one core; a short step (below
    LONG_STEP_TOKENS) keeps its threads to its end, and A's first decode step waits for that end (the core
    share's newcomer: core_share.py). Without the wait (room_wait_s=0, the services before 2026-11-29) the
    short step ran oversubscribed (a 2-thread team beside a thread, at 2/3 of a core each times team_speed)."""
    from shared.engine import core_share, engine
    from shared.planner.profile import EngineCurves
    from shared.planner.sim_engine import LONG_STEP_TOKENS, ROOM_WAIT_S

    assert LONG_STEP_TOKENS == engine._LONG_STEP_TOKENS and ROOM_WAIT_S == core_share.ROOM_WAIT_S
    profile = make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.02, 0.0, 0.0), pull=(0.03, 0.0))
    profile.engines[2] = EngineCurves(prefill_fit=[0.0, 0.0005, 0.0], decode_fit=[0.01, 0.0, 0.0])
    a, b = simulate(profile, Shape(1, 1), [TraceRequest(0.0, 10, 20), TraceRequest(0.01, prompt_tokens, 1)],
                    SimOptions(cores=2, team_speed=0.42))
    assert ttft_s(a) == pytest.approx(0.005)  # 10 tokens on both cores; A's decode waits 0.03 for its pull
    alone_s = prompt_tokens * 0.0005  # B's step on both cores from 0.01; A decodes from 0.035
    done = 0.025 / alone_s  # of B's step when A starts decoding
    if refits:
        assert ttft_s(b) == pytest.approx(0.025 + (1 - done) * prompt_tokens * 0.001)  # on one core
        return
    assert ttft_s(b) == pytest.approx(alone_s)  # alone on both cores to its end
    assert a.token_times_s[1] == pytest.approx(0.01 + alone_s + 0.01)  # A's first step after it, alone again
    a, b = simulate(profile, Shape(1, 1), [TraceRequest(0.0, 10, 20), TraceRequest(0.01, prompt_tokens, 1)],
                    SimOptions(cores=2, team_speed=0.42, room_wait_s=0.0))
    assert ttft_s(b) == pytest.approx(0.025 + (1 - done) * alone_s / (2 / 3 * 0.42))


def test_an_oversubscribed_thread_team_runs_below_processor_sharing() -> None:
    """A 2-thread engine stepping beside a 1-thread one on 2 cores: processor sharing would give each thread
    2/3 of a core; the 2-thread team's barriers make it `team_speed` of that (bench/omp_contention.py)."""
    host = Host(2, team_speed=0.42)
    host.change(2)
    assert host.speed(2) == 1.0 and host.speed(1) == 1.0  # not oversubscribed
    host.change(1)
    assert host.speed(1) == pytest.approx(2 / 3)
    assert host.speed(2) == pytest.approx(2 / 3 * 0.42)
    profile = make_profile(prefill=(0.0, 0.001, 0.0))
    trace = [TraceRequest(0.0, 100, 1), TraceRequest(0.0, 100, 1)]
    # two engines of 2 threads each on 2 cores: 4 threads, each team at 1/2 x team_speed
    teams = simulate(profile, Shape(0, 2, colocated=True), trace,
                     SimOptions(policy="round_robin", cores=2, threads_per_engine=2, team_speed=0.5))
    assert [ttft_s(r) for r in teams] == pytest.approx([0.4, 0.4])
    shared = simulate(profile, Shape(0, 2, colocated=True), trace,
                      SimOptions(policy="round_robin", cores=2, threads_per_engine=2, team_speed=1.0))
    assert [ttft_s(r) for r in shared] == pytest.approx([0.2, 0.2])


def test_a_prompt_reaching_prefill_mid_decode_step_waits_for_that_step_then_both_share() -> None:
    """What the services do since 2026-11-29 (core_share.py): A decodes alone on both cores (0.01 a step); B
    reaches prefill 0.004 into one of A's steps. B waits for that step's end instead of starting beside it, and
    then B prefills on one core while A's steps run on the other (0.02 each). With room_wait_s=0, as before,
    A's step in flight ran oversubscribed beside B (a 2-thread team at 2/3 x team_speed of its speed)."""
    from shared.planner.profile import EngineCurves

    profile = make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.02, 0.0, 0.0))
    profile.engines[2] = EngineCurves(prefill_fit=[0.0, 0.0005, 0.0], decode_fit=[0.01, 0.0, 0.0])
    trace = [TraceRequest(0.0, 10, 40), TraceRequest(0.049, 100, 1)]
    a, b = simulate(profile, Shape(1, 1), trace, SimOptions(cores=2, team_speed=0.42))
    # A: prefilled on both cores by 0.005, decodes from then on: steps end at 0.015, 0.025, ... 0.055
    assert a.token_times_s[1:6] == pytest.approx([0.015, 0.025, 0.035, 0.045, 0.055])
    assert ttft_s(b) == pytest.approx(0.006 + 100 * 0.001)  # waited for A's step to end at 0.055, one core
    assert a.token_times_s[6] - a.token_times_s[5] == pytest.approx(0.02)  # A on its share beside B
    _, before = simulate(profile, Shape(1, 1), trace, SimOptions(cores=2, team_speed=0.42, room_wait_s=0.0))
    assert ttft_s(before) > ttft_s(b)  # B's prefill shared the cores with A's oversubscribed step


def test_engines_stepping_at_once_run_at_their_corun_speed() -> None:
    """The case above with the memory bus shared (bench/corun.py): while B's prefill and A's decode steps run
    at once, each on its own core, the prefill runs at half its speed and the decode at 0.8; A alone again
    after B runs at full speed."""
    from shared.planner.profile import EngineCurves

    profile = make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.02, 0.0, 0.0))
    profile.engines[2] = EngineCurves(prefill_fit=[0.0, 0.0005, 0.0], decode_fit=[0.01, 0.0, 0.0])
    trace = [TraceRequest(0.0, 10, 40), TraceRequest(0.049, 100, 1)]
    a, b = simulate(profile, Shape(1, 1), trace,
                    SimOptions(cores=2, team_speed=0.42, corun_speed={"prefill": 0.5, "decode": 0.8}))
    assert a.token_times_s[1:6] == pytest.approx([0.015, 0.025, 0.035, 0.045, 0.055])  # alone: unchanged
    assert ttft_s(b) == pytest.approx(0.006 + 100 * 0.001 / 0.5)
    assert a.token_times_s[6] - a.token_times_s[5] == pytest.approx(0.02 / 0.8)  # beside B's prefill
    assert a.token_times_s[-1] - a.token_times_s[-2] == pytest.approx(0.01)  # alone again, both cores
