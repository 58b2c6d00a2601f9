"""The compose stack for real: the image built by podman, `podman-compose up` on the host network.

    build baton + redis images (offline base, wheelhouse)
    overlay variable unset          -> `up` fails naming it
    kv_transfer up, no Redis        -> exits non-zero with the reason, the restart policy brings it back
    the whole stack (+ OTLP receiver)  -> openai client streams an answer, a trace reaches the receiver
    --scale decode=2                -> two decode replicas, each on its own OS-picked port
    SIGKILL a decode mid-stream     -> the stream finishes or fails cleanly; the next request is served
    down                            -> no container, pod or network of the project left

Every service listens on 127.0.0.1 (deploy/compose/host-network.yml); the tests run the containers'
health checks themselves (podman 4.3 schedules them only through systemd).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from shared.registry import RedisRegistry
from shared.service.ports import unused_port
from tests.deploy.images import BATON_IMAGE, REDIS_IMAGE, baton_image, redis_image, require_podman, run
from tests.deploy.podman_stack import ComposeStack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "smollm2-135m"
STARTUP_TIMEOUT_S = 240.0
STREAM_TIMEOUT_S = 120.0


def _variables() -> dict[str, str]:
    ports: set[int] = set()
    for _ in range(3):  # three distinct ports: each pick is free now, so two picks could be the same one
        ports.add(unused_port(avoid=ports))
    redis_port, router_port, otlp_port = sorted(ports)
    return {
        "BATON_IMAGE": BATON_IMAGE, "BATON_REDIS_IMAGE": REDIS_IMAGE,
        "BATON_HOST_REDIS_PORT": str(redis_port), "BATON_HOST_ROUTER_PORT": str(router_port),
        "BATON_HOST_OTLP_PORT": str(otlp_port),
        # a small machine's .env: small KV budgets, one torch thread per engine, tracing on
        "BATON_MAX_MODEL_LEN": "1024", "BATON_KV_CACHE_BYTES": str(64 << 20),
        "BATON_KV_TRANSFER_CAPACITY_BYTES": str(256 << 20), "BATON_KV_TRANSFER_TRANSPORT": "tcp",
        "BATON_TORCH_THREADS": "1", "COMPOSE_PROFILES": "otel", "OTEL_SDK_DISABLED": "false",
        "BATON_INTERNAL_TOKEN": secrets.token_hex(16),
    }


@pytest.fixture(scope="module")
def stack() -> Iterator[ComposeStack]:
    require_podman()
    baton_image()
    redis_image()
    stack = ComposeStack(f"batontest{os.getpid()}", _variables())
    try:
        yield stack
    finally:
        stack.down()  # also when a test failed; test_down_leaves_nothing_behind checks it


def _client(stack: ComposeStack) -> openai.OpenAI:
    port = stack.env["BATON_HOST_ROUTER_PORT"]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=STREAM_TIMEOUT_S,
                         max_retries=0)


def _stream(client: openai.OpenAI, max_tokens: int, ignore_eos: bool = False,
            finish_reasons: list[str] | None = None) -> Iterator[str]:
    """The streamed text's pieces; each choice's finish reason goes to `finish_reasons`."""
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to fifty in words."}],
        max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": ignore_eos},
    )
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason is not None and finish_reasons is not None:
                finish_reasons.append(choice.finish_reason)
            if choice.delta.content:
                yield choice.delta.content


def test_an_unset_overlay_variable_fails_naming_it(stack: ComposeStack) -> None:
    unset = {k: v for k, v in stack.env.items() if k != "BATON_HOST_ROUTER_PORT"}
    saved, stack.env = stack.env, unset
    try:
        result = stack.compose("config", check=False)
    finally:
        stack.env = saved
    assert result.returncode != 0
    assert "BATON_HOST_ROUTER_PORT" in result.stderr + result.stdout


def test_a_service_without_redis_exits_with_the_reason_and_is_restarted(stack: ComposeStack) -> None:
    stack.compose("up", "-d", "--no-deps", "kv_transfer")
    (name,) = stack.containers("kv_transfer", all_states=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while int(str(stack.inspect(name)["RestartCount"])) < 1:
        assert time.monotonic() < deadline, stack.logs(name)[-3000:]
        time.sleep(1.0)
    logs = stack.logs(name)
    assert "cannot reach the registry" in logs and stack.env["BATON_HOST_REDIS_PORT"] in logs, logs[-3000:]
    # Redis comes up: the next restart connects and serves
    stack.compose("up", "-d", "redis")
    stack.wait_healthy(name, time.monotonic() + STARTUP_TIMEOUT_S)


def test_the_stack_streams_an_answer_and_traces_it(stack: ComposeStack) -> None:
    stack.compose("up", "-d")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for service in ("redis", "kv_transfer", "prefill", "decode", "router"):
        for name in stack.containers(service):
            stack.wait_healthy(name, deadline)
    text = "".join(_stream(_client(stack), max_tokens=24))
    assert text.strip(), "empty answer"
    (receiver,) = stack.containers("otel-collector")
    while True:  # the services export in batches (every few seconds)
        spans = [json.loads(line) for line in stack.logs(receiver).splitlines() if line.startswith("{")]
        if {"baton-router", "baton-prefill", "baton-decode"} <= {s["service"] for s in spans}:
            break
        assert time.monotonic() < deadline, f"no trace from every service: {spans[:20]}"
        time.sleep(1.0)
    router_traces = {s["trace_id"] for s in spans if s["service"] == "baton-router"}
    assert router_traces & {s["trace_id"] for s in spans if s["service"] == "baton-decode"}, "trace not joined"


def test_decode_scales_to_two_replicas_on_their_own_ports(stack: ComposeStack) -> None:
    stack.compose("up", "-d", "--no-recreate", "--scale", "decode=2", "decode")
    replicas = stack.containers("decode")
    assert len(replicas) == 2, replicas
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for name in replicas:
        stack.wait_healthy(name, deadline)
    assert len({stack.port_of(name) for name in replicas}) == 2


async def _busy_decode_port(redis_url: str, deadline: float) -> int:
    """The port of the decode whose registry entry reports a running request (its heartbeat load)."""
    registry = RedisRegistry.from_url(redis_url, "baton")
    try:
        while True:
            busy = [i for i in await registry.list("decode") if i.load.num_running > 0]
            if busy:
                return int(busy[0].address.rsplit(":", 1)[1])
            assert time.monotonic() < deadline, "no decode reported the running stream"
            await asyncio.sleep(0.2)
    finally:
        await registry.close()


def _serving_decode(stack: ComposeStack, deadline: float) -> str:
    """The decode replica running the stream: its registry entry's load, matched by port."""
    by_port = {stack.port_of(name): name for name in stack.containers("decode")}
    url = f"redis://127.0.0.1:{stack.env['BATON_HOST_REDIS_PORT']}/0"
    return by_port[asyncio.run(_busy_decode_port(url, deadline))]


def test_killing_a_decode_mid_stream_ends_the_stream_cleanly(stack: ComposeStack) -> None:
    client = _client(stack)
    pieces: list[str] = []
    finish_reasons: list[str] = []
    outcome: dict[str, object] = {}

    def consume() -> None:
        try:
            for piece in _stream(client, max_tokens=400, ignore_eos=True, finish_reasons=finish_reasons):
                pieces.append(piece)
            outcome["finished"] = finish_reasons
        except openai.APIError as exc:  # the clean failure: an error event the client raises
            outcome["error"] = exc

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    while len(pieces) < 4:
        assert reader.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.05)
    victim = _serving_decode(stack, deadline)
    run(["podman", "kill", "--signal", "KILL", victim])
    reader.join(timeout=STREAM_TIMEOUT_S)
    assert not reader.is_alive(), "the stream hung after its decode was killed"
    # finished (the survivor had it: a finish reason) or failed with an error, never cut off silently
    assert outcome.get("finished") == ["length"] or "error" in outcome, (outcome, len(pieces))
    # the survivor (or the restarted replica) serves the next request
    assert "".join(_stream(client, max_tokens=8)).strip()


def test_down_leaves_nothing_behind(stack: ComposeStack) -> None:
    assert stack.containers(), "nothing was running"
    stack.down()
    assert not stack.leftovers()
