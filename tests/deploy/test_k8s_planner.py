"""deploy/k8s/overlays/planner-autoscaling: valid for the Kubernetes API, the planner's command line is one
`baton autoscale` accepts with a profile that loads, and each engine HPA follows its service's desired
replicas."""

from __future__ import annotations

from pathlib import Path

from shared.cli.main import build_parser
from shared.planner.profile import Profile
from tests.deploy.conftest import require_module
from tests.deploy.kubectl import kubectl_render

OVERLAY = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "overlays" / "planner-autoscaling"


def test_planner_overlay() -> None:
    kv = require_module("kubernetes_validate", "kubernetes-validate")
    resources = kubectl_render(OVERLAY)
    for r in resources:
        kv.validate(r, kv.latest_version(), strict=True)
    by_name = {(r["kind"], r["metadata"]["name"]): r for r in resources}
    for service, deployment in (("prefill", "baton-prefill"), ("decode", "baton-decode"),
                                ("kv_transfer", "baton-kv-transfer")):
        [metric] = by_name[("HorizontalPodAutoscaler", deployment)]["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"] == {"name": "baton_planner_desired_replicas",
                                                "selector": {"matchLabels": {"service": service}}}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    planner = by_name[("Deployment", "baton-planner")]["spec"]["template"]["spec"]
    [container] = planner["containers"]
    assert container["image"] == "baton:0.1.0-cpu"
    args = build_parser().parse_args(container["args"])
    assert args.command == "autoscale" and args.port == 9500
    assert args.router_metrics == "dns+http://baton-router-pods:8000/metrics"
    assert by_name[("Service", "baton-router-pods")]["spec"]["clusterIP"] == "None"
    profile_map = next(r for (kind, name), r in by_name.items()
                       if kind == "ConfigMap" and name.startswith("baton-planner-profile"))
    assert planner["volumes"][0]["configMap"]["name"] == profile_map["metadata"]["name"]
    Profile.load(OVERLAY / "profile.json")  # what the planner will read
