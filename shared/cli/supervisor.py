"""`baton up`'s watch over its children: ports checked before anything starts, a health check that
knows its own router, and a bounded restart policy when a child fails.

    plan ─► every port free? (no: refuse, naming the port and who needed it) ─► start children
         ─► ready when each answers its health check (the router with the instance id given it)
         ─► a child fails (non-zero exit, a signal): restart it after 1, 2, 4 ... s (at most
                           --max-restarts times each, logged); restarts used up: stop the rest, exit 1
         ─► a child exits cleanly (drained on SIGTERM): not restarted; the router doing so stops the stack

A stack that half-runs is worse than one that stops: with the router's port taken by another stack,
the old `baton up` took that stack's health answer for its own router's, said "ready", and kept
serving nothing when its router exited.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shared.errors import ConfigError

__all__ = ["RestartPolicy", "Supervisor", "SupervisedChild", "check_ports_free"]


class SupervisedChild(Protocol):
    name: str
    env: dict[str, str]

    def exit_code(self) -> int | None: ...  # None while it runs


def _ports(child: SupervisedChild) -> list[int]:
    """The TCP ports a child binds, from its environment (BATON_<SERVICE>_PORT / _METRICS_PORT)."""
    return [int(v) for k, v in child.env.items() if k.endswith("_PORT") and v.isdigit() and int(v) > 0]


def check_ports_free(children: list[SupervisedChild], host: str) -> None:
    """Refuse before anything starts when a port a child needs is taken (another stack, an old run)."""
    for child in children:
        for port in _ports(child):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is no owner
                try:
                    s.bind((host, port))
                except OSError as exc:
                    raise ConfigError(f"port {port} on {host}, which {child.name} needs, is in use ({exc.strerror}): "
                                      "another stack or server holds it; stop it or choose another --port") from None


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # per child; 0 = the first failure stops the stack
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay_s(self, attempt: int) -> float:
        """Wait before restart number `attempt` (1-based): doubling from the first, capped."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (attempt - 1))


@dataclass
class _State:
    restarts: int = 0
    restart_at: float | None = None  # a restart is due then (monotonic s)


@dataclass
class Supervisor:
    """Restarts failed children per the policy; `poll` says why the stack must stop, or None."""

    children: list[SupervisedChild]
    policy: RestartPolicy
    restart: Callable[[SupervisedChild], None]
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    front: str = "router"  # without it nothing is served: its clean exit stops the stack too
    _states: dict[str, _State] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)  # exited cleanly

    def poll(self) -> str | None:
        now = self.clock()
        for child in self.children:
            state = self._states.setdefault(child.name, _State())
            if state.restart_at is not None:
                if now >= state.restart_at:
                    state.restart_at = None
                    self.restart(child)
                    self.say(f"baton: restarted {child.name} (restart {state.restarts} of "
                             f"{self.policy.max_restarts})")
                continue
            code = child.exit_code()
            if code is None or child.name in self._done:
                continue
            if code == 0:  # drained (an operator's SIGTERM): leaving is what it was asked to do
                if child.name == self.front:
                    return f"{child.name} exited: stopping the stack"
                self._done.add(child.name)
                self.say(f"baton: {child.name} exited cleanly (drained); not restarted")
                continue
            if state.restarts >= self.policy.max_restarts:
                return (f"{child.name} exited with {code}" + (f" after {state.restarts} restarts" if state.restarts
                                                               else "") + ": stopping the stack")
            state.restarts += 1
            delay_s = self.policy.delay_s(state.restarts)
            state.restart_at = now + delay_s
            self.say(f"baton: {child.name} exited with {code}; restarting it in {delay_s:.0f} s")
        return None

    def restarts(self, name: str) -> int:
        return self._states[name].restarts if name in self._states else 0
