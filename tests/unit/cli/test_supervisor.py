"""`baton up`'s supervisor: port checks before start, bounded restarts with backoff, then a stop."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import pytest

from shared.cli.supervisor import RestartPolicy, Supervisor, check_ports_free
from shared.errors import ConfigError


@dataclass
class FakeChild:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    code: int | None = None
    starts: int = 0

    def exit_code(self) -> int | None:
        return self.code


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def supervisor(children: list[FakeChild], max_restarts: int = 2) -> tuple[Supervisor, Clock, list[str]]:
    clock, said = Clock(), []

    def restart(child: FakeChild) -> None:  # type: ignore[misc]
        child.code, child.starts = None, child.starts + 1

    return Supervisor(children, RestartPolicy(max_restarts, 1.0, 3.0), restart, said.append, clock), clock, said


def test_backoff_doubles_and_is_capped() -> None:
    policy = RestartPolicy(5, 1.0, 3.0)
    assert [policy.delay_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 3.0]


def test_an_exited_child_is_restarted_after_its_backoff_then_the_stack_stops() -> None:
    decode, router = FakeChild("decode-0"), FakeChild("router")
    sup, clock, said = supervisor([decode, router])
    assert sup.poll() is None and decode.starts == 0
    decode.code = -9
    assert sup.poll() is None and decode.starts == 0  # waits its backoff
    assert "decode-0 exited with -9; restarting it in 1 s" in said[-1]
    clock.now += 0.5
    assert sup.poll() is None and decode.starts == 0
    clock.now += 0.6
    assert sup.poll() is None and decode.starts == 1 and sup.restarts("decode-0") == 1
    decode.code = 1
    sup.poll()
    clock.now += 1.5
    assert sup.poll() is None and decode.starts == 1  # the second backoff is 2 s
    clock.now += 0.6
    assert sup.poll() is None and decode.starts == 2
    decode.code = 1  # restarts used up
    reason = sup.poll()
    assert reason is not None and "decode-0 exited with 1 after 2 restarts" in reason
    assert router.starts == 0 and sup.restarts("router") == 0


def test_no_restarts_stops_on_the_first_exit() -> None:
    router = FakeChild("router", code=3)
    sup, _, _ = supervisor([router], max_restarts=0)
    assert sup.poll() == "router exited with 3: stopping the stack"


def test_a_taken_port_is_refused_naming_it_and_its_child() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port {port} on 127.0.0.1, which router needs, is in use"):
            check_ports_free([FakeChild("decode-0", {"BATON_DECODE_PORT": "0"}),
                              FakeChild("router", {"BATON_ROUTER_PORT": str(port), "BATON_ROUTER_MODEL": "x"})],
                             "127.0.0.1")
    check_ports_free([FakeChild("router", {"BATON_ROUTER_PORT": str(port)})], "127.0.0.1")  # released: free


def test_a_clean_exit_is_not_restarted_unless_it_is_the_router() -> None:
    prefill, router = FakeChild("prefill-1"), FakeChild("router")
    sup, clock, said = supervisor([prefill, router])
    prefill.code = 0  # drained after SIGTERM
    assert sup.poll() is None
    clock.now += 60
    assert sup.poll() is None and prefill.starts == 0 and said == ["baton: prefill-1 exited cleanly (drained); "
                                                                    "not restarted"]
    router.code = 0
    assert sup.poll() == "router exited: stopping the stack"
