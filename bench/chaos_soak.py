"""Chaos soak: streamed greedy requests through `baton up` while a controller kills its parts in turn.

```
 redis-server (own port) ◄─── baton up --prefill 2 --decode 2 (supervisor restarts what dies)
        │
 reference: each distinct prompt once, no fault ─► the tokens every completed stream must equal
        │
 load: --requests streams, --concurrency at a time, --cancel-fraction closed early by the client
        │            controller, in turn: SIGKILL prefill-0 ─► wait until it is back ─► decode-0 (once
        │            it runs a request) ─► ...
        │            kv_transfer ─► Redis (restarted empty, same port) ─► router; --rounds times
        ▼
 every stream: completed (text == reference), cancelled by its client, or an error that came within
 30 s of its last byte (never a hang) ─► engines' KV blocks and kv_transfer's leases back to their
 totals ─► RSS and open fds of the processes that were never killed, before vs after
        ─► JSON in bench/results/chaos_soak-*.json (last stdout line: the summary)
```

    .venv/bin/python -m bench.chaos_soak [--requests 1000] [--concurrency 8] [--rounds 1]

tests/e2e/test_chaos_soak.py runs a bounded soak (under 10 minutes) and asserts the invariants.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.results_file import write_results
from tests.helpers.redis_server import free_port, start_redis, stop_redis
from tests.helpers.stack import BatonStack, start_stack

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("bench.chaos_soak")

MODEL = "smollm2-135m"
API_KEY = "soak-key"
ENGINES = ("prefill-0", "prefill-1", "decode-0", "decode-1")
VICTIMS = ("prefill-0", "decode-0", "kv_transfer", "redis", "router")
SURVIVORS = ("prefill-1", "decode-1")  # never killed: their memory and fds must stay flat
# a metric each service exports from its start, so that reading it proves it serves
_ALWAYS_EXPORTED = {"router": "baton_router_migrations_total", "kv_transfer": "baton_handoff_leases_active"}
ERROR_WITHIN_S = 30.0  # a stream that fails must say so within this of its last byte
CLIENT_BACKOFF_S = 1.0  # a client finding no router waits this long before its next request
BUSY_WAIT_S = 20.0  # a decode victim is killed once it runs a request, or after this long


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 200
    concurrency: int = 8
    cancel_fraction: float = 0.1
    max_tokens: int = 16
    num_prompts: int = 8
    settle_s: float = 4.0  # load runs this long between one victim back and the next kill
    request_timeout_s: float = 120.0
    max_requests_factor: int = 4  # the load goes on past num_requests until every round of kills is done
    seed: int = 0
    rounds: int = 1  # times every victim is killed, in turn


@dataclass
class StreamOutcome:
    index: int
    prompt: int
    kind: str = "completed"  # completed | cancelled | error
    text: str = ""
    error: str = ""
    error_after_last_byte_s: float = 0.0


@dataclass
class FaultLog:
    events: list[dict[str, Any]] = field(default_factory=list)
    migrations_before_router_restarts: float = 0.0  # the router's counter starts again at each restart

    def add(self, victim: str, down_s: float, running: float | None) -> None:
        event: dict[str, Any] = {"victim": victim, "back_after_s": round(down_s, 2)}
        if running is not None:  # a decode: the requests it ran when it was killed
            event["running_at_kill"] = running
        self.events.append(event)


def _payload(prompt: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Count from {prompt} to {prompt + 30}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}


async def _stream(client: httpx.AsyncClient, url: str, outcome: StreamOutcome, max_tokens: int,
                  cancel_after: int | None) -> StreamOutcome:
    """One streamed request; `cancel_after`: deltas after which the client leaves."""
    parts: list[str] = []
    last_byte = time.monotonic()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        async with client.stream("POST", f"{url}/chat/completions", json=_payload(outcome.prompt, max_tokens),
                                 headers=headers) as r:
            if r.status_code != 200:
                outcome.kind, outcome.error = "error", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return outcome
            async for line in r.aiter_lines():
                last_byte = time.monotonic()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.kind, outcome.error = "error", event["error"]["message"][:200]
                    break
                parts.extend(c["delta"].get("content") or "" for c in event["choices"])
                if cancel_after is not None and len(parts) >= cancel_after:
                    outcome.kind = "cancelled"
                    break
    except (httpx.HTTPError, OSError) as e:  # the router itself was killed: the connection broke
        outcome.kind, outcome.error = "error", f"{type(e).__name__}: {e}"[:200]
        if isinstance(e, httpx.ConnectError):
            await asyncio.sleep(CLIENT_BACKOFF_S)  # as a client would, before its next try
    if outcome.kind == "error":
        outcome.error_after_last_byte_s = time.monotonic() - last_byte
    outcome.text = "".join(parts)
    return outcome


async def _load(url: str, config: SoakConfig, faults_done: threading.Event) -> list[StreamOutcome]:
    """Streams, `concurrency` at a time, until at least `num_requests` were sent and the controller has
    killed every victim once (at most `max_requests_factor` times as many)."""
    rng = random.Random(config.seed)
    gate = asyncio.Semaphore(config.concurrency)
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)

    async def one(index: int, client: httpx.AsyncClient) -> StreamOutcome:
        try:
            outcome = StreamOutcome(index, rng.randrange(config.num_prompts))
            cancel_after = rng.randrange(1, config.max_tokens) if rng.random() < config.cancel_fraction else None
            try:
                return await asyncio.wait_for(_stream(client, url, outcome, config.max_tokens, cancel_after),
                                              config.request_timeout_s)
            except TimeoutError:
                outcome.kind, outcome.error = "error", "hang: no end within the request timeout"
                outcome.error_after_last_byte_s = config.request_timeout_s
                return outcome
        finally:
            gate.release()

    tasks: list[asyncio.Task[StreamOutcome]] = []
    cap = config.num_requests * config.max_requests_factor
    async with httpx.AsyncClient(timeout=timeout) as client:
        while len(tasks) < cap and (len(tasks) < config.num_requests or not faults_done.is_set()):
            await gate.acquire()
            tasks.append(asyncio.create_task(one(len(tasks), client)))
            if len(tasks) % 25 == 0:
                logger.info("soak: %d streams sent (%d ended)", len(tasks), sum(t.done() for t in tasks))
        outcomes = await asyncio.gather(*tasks)
    return sorted(outcomes, key=lambda o: o.index)


def _proc_stats(pid: int) -> dict[str, int]:
    """Resident memory (KiB) and open file descriptors of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss_kib": rss_kib, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Controller:
    """Kills the victims in turn while the load runs, each after the last one came back."""

    def __init__(self, stack: BatonStack, redis: dict[str, Any], config: SoakConfig, log: FaultLog) -> None:
        self.stack, self.redis, self.config, self.log = stack, redis, config, log

    def run(self, faults_done: threading.Event, load_done: threading.Event) -> None:
        """Every victim in turn, `rounds` times (then `faults_done`), unless the load ends first."""
        try:
            for victim in VICTIMS * self.config.rounds:
                if load_done.wait(self.config.settle_s):
                    return
                self._fault(victim)
        finally:
            faults_done.set()

    def _fault(self, victim: str) -> None:
        """SIGKILL `victim` (Redis: and restart it, empty, on its port) and wait until it serves again."""
        running = self._wait_busy(victim) if victim.startswith("decode") else None
        t0 = time.monotonic()
        if victim == "redis":
            stop_redis(self.redis["proc"], kill=True)
            self.redis["proc"], _ = start_redis(self.redis["port"])
        else:
            old = self.stack.service(victim)["pid"]
            if victim == "router":
                self.log.migrations_before_router_restarts += self.stack.metric("router", _ALWAYS_EXPORTED["router"])
            self.stack.kill(victim)
            self._wait_back(victim, old)
        self.log.add(victim, time.monotonic() - t0, running)
        logger.info("soak: %s killed (running %s), back after %.1f s", victim, running, time.monotonic() - t0)

    def _wait_busy(self, victim: str) -> float:
        """Until the decode `victim` runs a request (at most BUSY_WAIT_S), so that its kill breaks streams in
        flight: a kill between two streams tests nothing, and the router's spread decides whether one runs
        there at a given moment. The requests it ran when it was killed. (A prefill call lasts less than a
        metrics scrape: prefill-0 dies under load, whatever it computes at that moment.)"""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            try:
                running = self.stack.metric(victim, "baton_num_requests_running")
            except (OSError, KeyError, ValueError):
                running = 0.0
            if running > 0 or time.monotonic() > deadline:
                return running
            time.sleep(0.02)

    def _wait_back(self, victim: str, old_pid: int) -> None:
        """Until the supervisor restarted `victim` and it answers on its metrics port."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if self.stack.service(victim)["pid"] != old_pid:
                    self.stack.metric(victim, _ALWAYS_EXPORTED.get(victim, "baton_kv_blocks_total"))
                    return
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{victim} did not come back within 240 s")


def _references(url: str, config: SoakConfig) -> dict[int, str]:
    async def run() -> dict[int, str]:
        async with httpx.AsyncClient(timeout=120) as client:
            outs = [await _stream(client, url, StreamOutcome(-1, p), config.max_tokens, None)
                    for p in range(config.num_prompts)]
        for o in outs:
            if o.kind != "completed":
                raise RuntimeError(f"reference run failed: {o.error}")
        return {o.prompt: o.text for o in outs}

    return asyncio.run(run())


def _wait_idle(stack: BatonStack, timeout_s: float) -> dict[str, Any]:
    """Every engine's KV blocks free and no kv_transfer lease live; what was seen last."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen: dict[str, Any] = {}
        try:
            for name in ENGINES:
                seen[name] = [stack.metric(name, "baton_kv_blocks_free"), stack.metric(name, "baton_kv_blocks_total")]
            seen["kv_transfer_leases"] = stack.metric("kv_transfer", "baton_handoff_leases_active")
            if all(free == total for free, total in (seen[n] for n in ENGINES)) and seen["kv_transfer_leases"] == 0:
                seen["idle"] = True
                return seen
        except (OSError, KeyError) as e:
            seen["error"] = str(e)
        if time.monotonic() > deadline:
            seen["idle"] = False
            return seen
        time.sleep(0.5)


def run_soak(config: SoakConfig, state_dir: Path) -> dict[str, Any]:
    """The soak's full report (see the module docstring); raises only when the stack cannot start."""
    port = free_port()
    proc, redis_url = start_redis(port)
    redis = {"proc": proc, "port": port}
    stack = start_stack(state_dir, "--model", MODEL, "--max-model-len", "1024", "--kv-cache-bytes", str(96 << 20),
                        "--prefill", "2", "--decode", "2", "--redis-url", redis_url, "--api-key", API_KEY,
                        "--max-restarts", "20", "--restart-backoff", "0.5", "--decode-stall-timeout", "10")
    try:
        references = _references(stack.base_url, config)
        before = {name: _proc_stats(stack.service(name)["pid"]) for name in SURVIVORS}
        log = FaultLog()
        faults_done, load_done = threading.Event(), threading.Event()
        controller = threading.Thread(target=Controller(stack, redis, config, log).run, args=(faults_done, load_done),
                                      daemon=True)
        t0 = time.monotonic()
        controller.start()
        try:
            outcomes = asyncio.run(_load(stack.base_url, config, faults_done))
        finally:
            load_done.set()
        controller.join(timeout=300)
        elapsed_s = time.monotonic() - t0
        idle = _wait_idle(stack, 60)
        after = {name: _proc_stats(stack.service(name)["pid"]) for name in SURVIVORS}
        migrations = log.migrations_before_router_restarts + stack.metric("router", _ALWAYS_EXPORTED["router"])
        return _report(config, outcomes, references, log, idle, before, after, elapsed_s, migrations)
    finally:
        stack.stop()
        stop_redis(redis["proc"])


def _report(config: SoakConfig, outcomes: list[StreamOutcome], references: dict[int, str], log: FaultLog,
            idle: dict[str, Any], before: dict[str, Any], after: dict[str, Any], elapsed_s: float,
            migrations: float) -> dict[str, Any]:
    completed = [o for o in outcomes if o.kind == "completed"]
    errors = [o for o in outcomes if o.kind == "error"]
    cancelled = [o for o in outcomes if o.kind == "cancelled"]
    wrong = [asdict(o) for o in completed if o.text != references[o.prompt]]
    # a cancelled stream's text must be a prefix of the reference: nothing lost or repeated before it left
    wrong += [asdict(o) for o in cancelled if not references[o.prompt].startswith(o.text)]
    late = [asdict(o) for o in errors if o.error_after_last_byte_s > ERROR_WITHIN_S]
    return {
        "config": asdict(config), "elapsed_s": round(elapsed_s, 1), "faults": log.events,
        "num_completed": len(completed), "num_cancelled": len(cancelled), "num_errors": len(errors),
        "router_migrations": migrations,
        "wrong_text": wrong, "late_errors": late,
        "errors": sorted({o.error for o in errors})[:20],
        "idle_after": idle, "survivors_before": before, "survivors_after": after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="times every victim is killed, in turn")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the stack's logs stay (default: a fresh temporary directory, kept)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    config = SoakConfig(num_requests=args.requests, concurrency=args.concurrency,
                        cancel_fraction=args.cancel_fraction, max_tokens=args.max_tokens, seed=args.seed,
                        rounds=args.rounds)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="baton-soak-"))
    logger.info("stack state and logs in %s", state_dir)
    report = run_soak(config, state_dir)
    out = write_results(report, RESULTS, "chaos_soak", indent=1)
    logger.info("wrote %s", out)
    summary = {k: report[k] for k in ("elapsed_s", "num_completed", "num_cancelled", "num_errors",
                                      "router_migrations")}
    summary |= {"wrong_text": len(report["wrong_text"]), "late_errors": len(report["late_errors"]),
                "idle_after": report["idle_after"].get("idle")}
    print(json.dumps(summary))


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
