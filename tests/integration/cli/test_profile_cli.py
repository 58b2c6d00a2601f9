"""`baton profile --quick` as a user runs it: a real process, the packaged model, real services; then a plan
from what it measured, and the refusals of a profile taken on another machine or model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.planner.profile import MachineShape, Profile

pytestmark = pytest.mark.slow


def baton(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shared.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def test_quick_profile_then_plan(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    proc = baton("profile", "--quick", "--threads", "1", "--out", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile: threads 1 decode batch 16" in proc.stderr  # progress is logged
    profile = Profile.load(path)
    assert profile.model == "smollm2-135m"
    assert profile.model_identity.startswith("llama:30L:576H")
    assert profile.machine == MachineShape.this_machine()
    curves = profile.engines[1]
    assert len(curves.prefill_points) == 6 and len(curves.decode_points) == 6
    assert all(p[3] > 0 for p in curves.prefill_points) and all(p[2] > 0 for p in curves.decode_points)
    assert curves.prefill_step_s(512) > curves.prefill_step_s(16)  # more tokens take longer
    # 30 layers x 2 (K, V) x 3 heads x 64 x 4 bytes = 46,080 bytes of KV per token, plus the hidden states
    assert 46_080 <= profile.kv_bytes_per_token < 46_080 * 1.2
    assert profile.handoff.transport in ("nixl", "ucxx", "tcp")
    assert [len(p) for p in profile.handoff.points] == [3, 3]
    assert all(p[2] > 0 for p in profile.handoff.points)  # decode's pulls were timed

    plan = baton("plan", "--profile", str(path), "--workload", "chat", "--slo", "ttft=30,tpot=5", "--rate", "0.2",
                 "--num-requests", "40", "--shared-cores", str(MachineShape.this_machine().cores), "--max-per-service",
                 "2", timeout_s=120)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert json.loads(plan.stdout)["at_rate"]["predicted"]["slo_attainment"] >= 0.9

    other = json.loads(path.read_text())
    other["machine"]["cores"] += 6
    (tmp_path / "other.json").write_text(json.dumps(other))
    refused = baton("plan", "--profile", str(tmp_path / "other.json"), "--workload", "chat", "--slo",
                    "ttft=30,tpot=5", "--rate", "0.2", "--shared-cores", "2", timeout_s=120)
    assert refused.returncode == 2
    assert "measured on another machine shape" in refused.stderr
    wrong_model = baton("plan", "--profile", str(path), "--model", "gemma3-270m", "--workload", "chat", "--slo",
                        "ttft=30,tpot=5", "--rate", "0.2", timeout_s=120)
    assert wrong_model.returncode == 2
    assert "measured with model 'smollm2-135m'" in wrong_model.stderr


def test_profile_rejects_more_threads_than_cores(tmp_path: Path) -> None:
    proc = baton("profile", "--quick", "--threads", "999", "--out", str(tmp_path / "p.json"), timeout_s=120)
    assert proc.returncode == 2
    assert "--threads must be within 1.." in proc.stderr
