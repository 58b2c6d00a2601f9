"""Run a compose file's services as local processes on 127.0.0.1: no docker engine needed.

    plan_stack(compose)  per service: argv (entrypoint + command, as compose builds it), the
                         declared environment, every `expose`d port given a free local port
    LocalStack.start()   redis first, then the rest (their `depends_on: service_healthy`
                         waited on by running the dependency's own healthcheck command)
    LocalStack.wait_healthy()  each service's declared healthcheck, run as declared
    LocalStack.stop()    dependents first: SIGTERM each process group, SIGKILL what outlives the grace

What a container has and a host lacks is mapped, and only that: compose hostnames in
`host:port` values become 127.0.0.1 with that service's local port, `0.0.0.0` binds become
127.0.0.1, and `hostname` (which a container answers with its own resolvable name) answers
127.0.0.1 through a shim first on PATH.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.compose_file import dockerfile_entrypoint, service_environment
from tests.helpers.redis_server import free_port

LOOPBACK = "127.0.0.1"


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]  # the declared environment, localized
    ports: dict[int, int]  # container port -> local port
    healthcheck: list[str] | None
    depends_on: dict[str, str]  # service -> condition
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def log_tail(self, nbytes: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")


def _localize(value: str, ports: dict[tuple[str, int], int], names: set[str]) -> str:
    def repl(m: re.Match[str]) -> str:
        host, port = m.group(1), int(m.group(2))
        return f"{LOOPBACK}:{ports[(host, port)]}" if host in names else m.group(0)

    value = re.sub(r"\b([A-Za-z0-9_.-]+):(\d+)\b", repl, value)
    return LOOPBACK if value == "0.0.0.0" else value


def _depends_on(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: spec.get("condition", "service_started") for d, spec in deps.items()}


def plan_stack(compose: dict[str, Any]) -> dict[str, LocalService]:
    """Local argv, env and ports of every service not behind a profile."""
    services = {n: s for n, s in compose["services"].items() if not s.get("profiles")}
    ports = {(n, int(p)): free_port() for n, s in services.items() for p in s.get("expose", [])}
    names = set(services)
    image_entrypoint = dockerfile_entrypoint()
    plan: dict[str, LocalService] = {}
    for name, svc in services.items():
        own = {p: ports[(name, p)] for (n, p) in ports if n == name}
        env = {}
        for key, value in service_environment(svc).items():
            if key.endswith("_PORT") and value.isdigit() and int(value) in own:
                env[key] = str(own[int(value)])
            else:
                env[key] = _localize(value, ports, names)
        command = list(svc.get("command") or [])
        if "entrypoint" in svc:
            argv = [*svc["entrypoint"], *command]
        elif svc.get("build"):
            argv = [*image_entrypoint, *command]
        else:  # a stock image (redis): its command is the program
            argv = command
        test = (svc.get("healthcheck") or {}).get("test")
        if test and test[0] not in ("CMD", "CMD-SHELL"):
            raise ValueError(f"{name}: healthcheck test must start with CMD or CMD-SHELL")
        health = None if not test else test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]]
        plan[name] = LocalService(name, argv, env, own, health, _depends_on(svc))
    return plan


@dataclass
class LocalStack:
    services: dict[str, LocalService]
    workdir: Path
    base_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shim = self.workdir / "bin"
        shim.mkdir(parents=True, exist_ok=True)
        # in a container `hostname` prints a name the other containers resolve; here that is loopback
        (shim / "hostname").write_text(f"#!/bin/sh\necho {LOOPBACK}\n")
        (shim / "hostname").chmod(0o755)
        path = os.pathsep.join([str(shim), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        self.base_env = {"PATH": path, "HOME": os.environ.get("HOME", str(self.workdir)),
                         "LANG": "C.UTF-8", **self.base_env}

    def env_of(self, svc: LocalService) -> dict[str, str]:
        return {**self.base_env, **svc.env}

    def start(self, name: str, extra_args: list[str] | None = None) -> None:
        svc = self.services[name]
        svc.log_path = self.workdir / f"{name}.log"
        with svc.log_path.open("wb") as log:
            svc.proc = subprocess.Popen(
                [*svc.argv, *(extra_args or [])], env=self.env_of(svc), cwd=self.workdir, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def check(self, name: str, argv: list[str] | None = None, timeout_s: float = 10.0) -> bool:
        """One run of the service's healthcheck command (or `argv`): exit 0 = healthy."""
        svc = self.services[name]
        argv = argv or svc.healthcheck
        assert argv, f"{name} has no healthcheck"
        try:
            return subprocess.run(argv, env=self.env_of(svc), cwd=self.workdir, capture_output=True,
                                  timeout=timeout_s).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_healthy(self, name: str, deadline: float, argv: list[str] | None = None) -> None:
        svc = self.services[name]
        while not self.check(name, argv):
            if svc.proc is not None and svc.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {svc.proc.returncode}:\n{svc.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy in time:\n{svc.log_tail()}")
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop dependents before what they depend on (as compose does), each wave SIGTERM then SIGKILL."""
        for wave in reversed(self._waves()):
            running = [p for p in (self.services[n].proc for n in wave) if p is not None and p.poll() is None]
            for proc in running:
                _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in running:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait(timeout=5)

    def _waves(self) -> list[list[str]]:
        """Services grouped by dependency depth: wave 0 depends on nothing."""
        depth: dict[str, int] = {}

        def depth_of(name: str) -> int:
            if name not in depth:
                deps = self.services[name].depends_on
                depth[name] = 1 + max((depth_of(d) for d in deps if d in self.services), default=-1)
            return depth[name]

        for name in self.services:
            depth_of(name)
        return [[n for n in self.services if depth[n] == d] for d in range(max(depth.values(), default=-1) + 1)]


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group this test started (start_new_session=True)
    except ProcessLookupError:
        pass
