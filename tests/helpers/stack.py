"""`baton up` as a subprocess for end-to-end tests: start, wait for ready, inspect, stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.redis_server import free_port


@dataclass
class BatonStack:
    proc: subprocess.Popen[str]
    port: int
    state_dir: Path
    output: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def services(self) -> list[dict[str, Any]]:
        return list(json.loads((self.state_dir / "stack.json").read_text())["services"])

    def service(self, name: str) -> dict[str, Any]:
        return next(s for s in self.services() if s["name"] == name)

    def metric(self, name: str, metric: str, labels: str = "") -> float:
        """Sum of a metric's samples on one service's /metrics endpoint (`labels`: only the sample with
        exactly these, e.g. 'result="hit"')."""
        with urllib.request.urlopen(self.service(name)["metrics_url"], timeout=5) as r:
            text = r.read().decode()
        which = re.escape(f"{{{labels}}}") if labels else r"(?:\{[^}]*\})?"
        values = [float(m.group(1)) for m in re.finditer(rf"^{metric}{which} (\S+)$", text, re.M)]
        if not values:
            raise KeyError(f"{metric} not on {name}'s /metrics")
        return sum(values)

    def kill(self, name: str) -> None:
        os.kill(self.service(name)["pid"], signal.SIGKILL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_stack(state_dir: Path, *args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> BatonStack:
    """Start `baton up` (`env`: settings added to this process's environment, e.g. BATON_ROUTER_*); stacks
    sharing a Redis each get their own registry namespace."""
    port = free_port()
    if "--redis-url" in args and "--registry-namespace" not in args:
        args = (*args, "--registry-namespace", f"test-{uuid.uuid4().hex[:8]}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli.main", "up", "--port", str(port), "--state-dir", str(state_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    stack = BatonStack(proc, port, state_dir)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        stack.output.append(line)
        if line.startswith("baton ready:"):
            break
        if time.monotonic() > deadline:
            break
    else:
        pass
    if not any(line.startswith("baton ready:") for line in stack.output):
        stack.stop()
        logs = "".join(stack.output[-40:])
        raise RuntimeError(f"baton up did not become ready:\n{logs}")
    # keep draining its output so the pipe never blocks the launcher
    import threading

    threading.Thread(target=lambda: [stack.output.append(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return stack


@contextmanager
def disagg_and_colocated(tmp_path_factory: Any, *args: str,
                         disagg_args: tuple[str, ...] = ()) -> Iterator[dict[str, BatonStack]]:
    """Two stacks of the same `baton up` arguments: "disagg" (one prefill, one decode, and `disagg_args`)
    and "colocated"."""
    started: dict[str, BatonStack] = {}
    try:
        for mode, extra in (("disagg", ("--prefill", "1", "--decode", "1", *disagg_args)),
                            ("colocated", ("--mode", "colocated"))):
            started[mode] = start_stack(tmp_path_factory.mktemp(mode), *args, *extra)
        yield started
    finally:
        for stack in started.values():
            stack.stop()


def wait_idle(stack: BatonStack, engines: list[str] | None = None, timeout_s: float = 30.0) -> None:
    """Wait until every engine's KV blocks are free again and kv_transfer (where the stack has one) holds no
    lease; fails naming what is still held after `timeout_s`. `engines`: default every prefill, decode and
    colocated service of the stack."""
    names = {s["name"] for s in stack.services()}
    if engines is None:
        engines = sorted(n for n in names if n.startswith(("prefill", "decode", "colocated")))
    deadline = time.monotonic() + timeout_s
    while True:
        free = {n: (stack.metric(n, "baton_kv_blocks_free"), stack.metric(n, "baton_kv_blocks_total"))
                for n in engines}
        leases = stack.metric("kv_transfer", "baton_handoff_leases_active") if "kv_transfer" in names else 0.0
        if all(f == t for f, t in free.values()) and leases == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s} s: blocks {free}, leases {leases}")
        time.sleep(0.25)
