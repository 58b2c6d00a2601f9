"""Driving deploy/compose with podman-compose on the host network, and proving `down` left nothing.

    stack = ComposeStack(project, variables)      # variables: the overlay's required ports and images
    stack.compose("up", "-d", "kv_transfer")      # podman-compose -p project -f base -f overlay ...
    stack.containers("decode")                    # names of the service's running replicas
    stack.wait_healthy(name, deadline)            # `podman healthcheck run` (no systemd timers here)
    stack.down(); stack.leftovers()               # containers, pods, networks of the project: []

podman 4.3 runs no health checks on its own without systemd, so tests run them (the image's
`baton healthcheck`) the way the timer would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.deploy.compose_file import COMPOSE_FILE
from tests.deploy.images import run

OVERLAY_FILE = COMPOSE_FILE.with_name("host-network.yml")
PROJECT_LABEL = "io.podman.compose.project"


def podman_compose() -> str:
    """podman-compose 1.6.0 (a test dependency, beside this interpreter): Debian's 1.0.3 cannot run the files."""
    found = shutil.which("podman-compose", path=str(Path(sys.executable).parent)) or shutil.which("podman-compose")
    if found is None:
        pytest.fail("podman-compose not found: pip install podman-compose==1.6.0 (a test dependency)", pytrace=False)
    return found


class ComposeStack:
    def __init__(self, project: str, variables: Mapping[str, str]) -> None:
        self.project = project
        # the compose knobs, as a user's shell or .env would hold them; nothing of ours leaks in
        self.env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/root"), **variables}
        self.argv = [podman_compose(), "--in-pod", "false", "-p", project, "-f", str(COMPOSE_FILE),
                     "-f", str(OVERLAY_FILE)]

    def compose(self, *args: str, timeout_s: float = 300.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=timeout_s,
                                env=self.env, cwd=COMPOSE_FILE.parent)
        if check and result.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        filters = ["--filter", f"label={PROJECT_LABEL}={self.project}"]
        if service is not None:
            filters += ["--filter", f"label=io.podman.compose.service={service}"]
        out = run(["podman", "ps", *(["-a"] if all_states else []), *filters, "--format", "{{.Names}}"]).stdout
        return sorted(out.split())

    def inspect(self, name: str) -> dict[str, object]:
        (data,) = json.loads(run(["podman", "inspect", name]).stdout)
        return dict(data)

    def logs(self, name: str) -> str:
        result = run(["podman", "logs", name], check=False)
        return result.stdout + result.stderr

    def healthy(self, name: str) -> bool:
        return run(["podman", "healthcheck", "run", name], timeout_s=30, check=False).returncode == 0

    def wait_healthy(self, name: str, deadline: float) -> None:
        while not self.healthy(name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy in time:\n{self.logs(name)[-3000:]}")
            time.sleep(1.0)

    def port_of(self, name: str) -> int:
        """The gRPC port a replica bound (the OS's pick), from the port file its health check reads."""
        return int(run(["podman", "exec", name, "cat", "/tmp/baton-port"]).stdout.strip())

    def down(self) -> None:
        self.compose("down", "-t", "10", check=False, timeout_s=180)
        for _ in range(2):  # a failed `down` must not leave them behind; dependents go in the first pass
            for name in self.containers(all_states=True):
                run(["podman", "rm", "-f", "-t", "0", name], check=False)

    def leftovers(self) -> list[str]:
        """Whatever of this project still exists: containers, pods, networks."""
        left = [f"container {n}" for n in self.containers(all_states=True)]
        pods = run(["podman", "pod", "ls", "--format", "{{.Name}}"]).stdout.split()
        left += [f"pod {p}" for p in pods if self.project in p]
        networks = run(["podman", "network", "ls", "--format", "{{.Name}}"]).stdout.split()
        left += [f"network {n}" for n in networks if self.project in n]
        return left
