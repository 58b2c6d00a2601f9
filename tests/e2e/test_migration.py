"""Request migration against a real `baton up` stack: a decode SIGKILLed, or stopped (SIGSTOP), mid-stream,
or stopped before the streams sent to it have had a message (only its missing keepalives and unanswered
pings tell).

The clients' streams go on from another decode instance with no error, no gap and no repeated token:
the text each gets equals what the same greedy request gets from a stack with no fault. The stack runs
with mutual TLS between its services (`--tls`), which a plaintext caller cannot get past.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import MODEL_ARGS
from tests.e2e.test_load_and_faults import body, stream_text
from tests.helpers.stack import BatonStack, start_stack, wait_idle

pytestmark = pytest.mark.slow

NUM_STREAMS = 4
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatonStack]:
    stack = start_stack(tmp_path_factory.mktemp("migration"), *MODEL_ARGS, "--redis-url", redis_url,
                        "--registry-namespace", "migration", "--api-key", "test-key", "--prefill", "1",
                        "--decode", "2", "--decode-stall-timeout", "3", "--tls")
    yield stack
    stack.stop()


def _payload(i: int) -> dict[str, object]:
    return body(i, True, MAX_TOKENS, ignore_eos=True)


def _stream_all(stack: BatonStack) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            done = await asyncio.gather(*(stream_text(client, stack.base_url, _payload(i)) for i in range(NUM_STREAMS)))
            for text, finish in done:
                assert finish == "length", text
            return [text for text, _ in done]

    return asyncio.run(run())


_no_fault = _stream_all


def _busy_decode(stack: BatonStack, timeout_s: float = 60) -> str:
    """The decode instance with requests running (read before anything is done to it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in ("decode-0", "decode-1"):
            if stack.metric(name, "baton_num_requests_running") > 0:
                return name
        time.sleep(0.05)
    raise AssertionError("no decode instance was seen running requests")


def _streams_under_fault(stack: BatonStack, fault: str) -> tuple[list[str], str]:
    """Stream every request while `fault` ("kill" or "stop") hits the busy decode; the texts and its name."""
    async def run() -> tuple[list[str], str]:
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [asyncio.create_task(stream_text(client, stack.base_url, _payload(i)))
                       for i in range(NUM_STREAMS)]
            victim = await asyncio.to_thread(_busy_decode, stack)
            await asyncio.sleep(0.5)  # tokens are on their way to the clients
            if fault == "kill":
                stack.kill(victim)
            else:
                os.kill(stack.service(victim)["pid"], signal.SIGSTOP)
            try:
                done = await asyncio.gather(*streams)
            finally:
                if fault == "stop":
                    os.kill(stack.service(victim)["pid"], signal.SIGCONT)
            for text, finish in done:
                assert finish == "length", text
            return [text for text, _ in done], victim

    return asyncio.run(run())


def _wait_serving(stack: BatonStack, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for name in names:
                stack.metric(name, "baton_kv_blocks_total")
            return
        except (OSError, KeyError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_stack_speaks_mutual_tls_only(stack: BatonStack) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for name in ("decode-0", "kv_transfer"):
        with grpc.insecure_channel(stack.service(name)["address"]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS handshake, no call
    assert (stack.state_dir / "certs" / "ca.pem").is_file()


def test_a_decode_killed_mid_stream_hands_its_streams_on_unbroken(stack: BatonStack) -> None:
    expected = _no_fault(stack)
    before = stack.metric("router", "baton_router_migrations_total")
    got, victim = _streams_under_fault(stack, "kill")
    assert got == expected
    assert stack.metric("router", "baton_router_migrations_total") > before
    assert any("migrating" in line for line in (stack.state_dir / "logs" / "router.log").read_text().splitlines())
    _wait_serving(stack, [victim], 180)  # the supervisor restarts it
    wait_idle(stack, ["prefill-0", "decode-0", "decode-1"], 30)


def test_a_decode_gone_silent_mid_stream_is_left_and_frees_its_blocks_when_it_wakes(stack: BatonStack) -> None:
    _wait_serving(stack, ["decode-0", "decode-1"], 180)
    expected = _no_fault(stack)
    before = stack.metric("router", "baton_router_migrations_total")
    got, _ = _streams_under_fault(stack, "stop")
    assert got == expected
    assert stack.metric("router", "baton_router_migrations_total") > before
    # woken, the stopped instance finds its streams cancelled: it aborts them and frees their blocks
    wait_idle(stack, ["prefill-0", "decode-0", "decode-1"], 30)


def test_a_decode_stopped_before_its_streams_reach_it_is_left_within_its_stall_timeout(stack: BatonStack) -> None:
    _wait_serving(stack, ["decode-0", "decode-1"], 180)
    expected = _no_fault(stack)
    victim = stack.service("decode-1")
    router_log = stack.state_dir / "logs" / "router.log"
    num_log_lines = len(router_log.read_text().splitlines())
    os.kill(victim["pid"], signal.SIGSTOP)  # still registered: the router sends it some of the streams
    try:
        got = _stream_all(stack)
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    assert got == expected
    left = [line for line in router_log.read_text().splitlines()[num_log_lines:]
            if victim["address"] in line and "failed" in line]  # silent stream, or its pings unanswered
    assert left, "no stream was sent to the stopped decode"
    wait_idle(stack, ["prefill-0", "decode-0", "decode-1"], 30)
