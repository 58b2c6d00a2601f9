"""Workloads (fixed seeds, the replay format and its bad input) and profiles (round trip, refusals)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.planner.metrics import SLO
from shared.planner.profile import MachineShape, Profile
from shared.planner.workload import TraceRequest, load_trace, synthetic, workload, write_trace
from tests.unit.planner.factories import make_profile


@pytest.mark.parametrize("name", ["chat", "long-document", "agentic"])
def test_synthetic_is_fixed_by_its_seed(name: str) -> None:
    a, b = synthetic(name, 2.0, 200, seed=3), synthetic(name, 2.0, 200, seed=3)
    assert a == b
    assert a != synthetic(name, 2.0, 200, seed=4)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 and r.prefix_tokens <= r.prompt_tokens for r in a)
    mean_gap = a[-1].arrival_s / (len(a) - 1)
    assert 0.35 < mean_gap < 0.65  # Poisson at 2/s
    slower = synthetic(name, 1.0, 200, seed=3)  # the lengths stay when only the rate moves
    assert [r.prompt_tokens for r in slower] == [r.prompt_tokens for r in a]


def test_agentic_turns_extend_their_session() -> None:
    trace = synthetic("agentic", 1.0, 300, seed=0)
    last: dict[str, TraceRequest] = {}
    for r in trace:
        if r.prefix_group in last:
            before = last[r.prefix_group]
            assert r.prefix_tokens == before.prompt_tokens + before.output_tokens
        last[r.prefix_group] = r
    assert len(last) < len(trace) / 2  # sessions have several turns


def test_replay_round_trip_and_rate_scaling(tmp_path: Path) -> None:
    trace = [TraceRequest(10.0, 100, 5, "g", 50), TraceRequest(12.0, 80, 3), TraceRequest(14.0, 90, 4)]
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    loaded = load_trace(path)
    assert [r.arrival_s for r in loaded] == [0.0, 2.0, 4.0]  # starts at 0
    assert loaded[0] == TraceRequest(0.0, 100, 5, "g", 50)
    faster = workload(str(path), 2.0, 1000)  # 2 gaps over 4 s = 0.5/s, scaled to 2/s
    assert [r.arrival_s for r in faster] == pytest.approx([0.0, 0.5, 1.0])


@pytest.mark.parametrize("line,message", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"arrival_s": 0, "prompt_tokens": 5}', "missing field 'output_tokens'"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 3}', "prompt_tokens and output_tokens >= 1"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3, "prefix_tokens": 9}', "prefix_tokens"),
    ('{"arrival_s": "soon", "prompt_tokens": 5, "output_tokens": 3}', "trace.jsonl:1"),
])
def test_replay_bad_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_trace(path)


def test_unknown_workload_and_bad_rates() -> None:
    with pytest.raises(ConfigError, match="unknown workload 'poetry'"):
        synthetic("poetry", 1.0, 10)
    with pytest.raises(ConfigError, match="rate must be > 0"):
        synthetic("chat", 0.0, 10)
    with pytest.raises(ConfigError, match="needs --rate"):
        workload("chat", None, 10)


def test_slo_parsing() -> None:
    assert SLO.parse("ttft=1.5,tpot=100ms") == SLO(1.5, 0.1)
    assert SLO.parse("tpot=0.05s, ttft=2") == SLO(2.0, 0.05)
    for bad, message in [("ttft=1", "needs both"), ("ttft=-1,tpot=1", "positive"), ("ttft=a,tpot=1", "not a number"),
                         ("latency=1", "ttft=SECONDS")]:
        with pytest.raises(ConfigError, match=message):
            SLO.parse(bad)


def test_profile_round_trip_and_refusals(tmp_path: Path) -> None:
    profile = make_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded.to_json() == profile.to_json()
    assert loaded.curves(1).prefill_step_s(100) == pytest.approx(0.11)
    assert loaded.curves(8) is loaded.engines[1]  # the nearest thread count measured
    loaded.check_model("smollm2-135m")
    with pytest.raises(ConfigError, match="measured with model 'smollm2-135m'.*not 'gemma3-270m'"):
        loaded.check_model("gemma3-270m")
    loaded.check_machine(MachineShape(2, ("avx2", "avx512f"), "another name"))
    with pytest.raises(ConfigError, match="another machine shape \\(2 cores against 16\\)"):
        loaded.check_machine(MachineShape(16, ("avx2", "avx512f")))
    with pytest.raises(ConfigError, match="instruction sets avx2\\+avx512f against avx2"):
        loaded.check_machine(MachineShape(2, ("avx2",)))


def test_malformed_profiles_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        Profile.load(path)
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ConfigError, match="version 99"):
        Profile.load(path)
    data = make_profile().to_json()
    del data["handoff"]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="malformed profile"):
        Profile.load(path)
    with pytest.raises(ConfigError, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")


def test_fits_recover_the_points() -> None:
    profile = make_profile(prefill=(0.01, 0.002, 1e-7), decode=(0.03, 0.004, 2e-6))
    curves = profile.engines[1]
    curves.prefill_fit, curves.decode_fit = [0, 0, 0], [0, 0, 0]
    curves.refit()
    assert curves.prefill_fit == pytest.approx([0.01, 0.002, 1e-7], rel=1e-6, abs=1e-9)
    assert curves.decode_fit == pytest.approx([0.03, 0.004, 2e-6], rel=1e-6, abs=1e-9)


def test_cost_model_takes_the_profile_coefficients() -> None:
    profile = make_profile(prefill=(0.01, 0.002, 0.0), decode=(0.02, 0.004, 0.0), push=(0.003, 0.0),
                           pull=(0.001, 1e-9), kv_bytes_per_token=1000)
    model = profile.cost_model(1)
    assert model.prefill_s_per_token == 0.002
    assert model.decode_s_per_request == 0.004
    assert model.transfer_s_per_block == pytest.approx(1e-9 * 1000 * 16)
    assert model.handoff_overhead_s == pytest.approx(0.004)
