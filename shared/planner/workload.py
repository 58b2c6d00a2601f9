"""Workloads for the planner: fixed-seed synthetic request streams, and a replay format for one's own trace.

A workload is a list of `TraceRequest`s: when it arrives, how long its prompt and output are, and
which prefix group it shares leading prompt tokens with (a system prompt, an agent's growing context).

```
 chat          prompts ~ lognormal around 220 tokens (40..1,500), outputs ~ lognormal around 120 (8..512);
               every prompt opens with one of 4 system prompts of 32 tokens
 long-document prompts 1,000..3,500 tokens, outputs 40..200; no shared prefix
 agentic       sessions of 3..8 turns; a turn's prompt is the session's whole context so far (the
               previous prompt, its output and 30..120 new tokens), shared as prefix group "s<k>"
```

Replay (JSONL, one request a line; `prefix_group` and `prefix_tokens` optional):

    {"arrival_s": 0.0, "prompt_tokens": 812, "output_tokens": 64, "prefix_group": "s1", "prefix_tokens": 700}

Arrivals of a synthetic workload are Poisson at the rate asked; a replayed trace keeps its own times
unless a rate is given, then they are scaled so that its mean rate is that rate.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError

WORKLOADS = ("chat", "long-document", "agentic")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: str = ""  # requests of one group share their first `prefix_tokens` prompt tokens
    prefix_tokens: int = 0


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def _shapes(name: str, num_requests: int, rng: random.Random) -> list[tuple[int, int, str, int]]:
    """(prompt, output, prefix group, prefix tokens) of each request, in arrival order."""
    if name == "chat":
        return [(_lognormal(rng, 220, 0.8, 40, 1500), _lognormal(rng, 120, 0.7, 8, 512),
                 f"system-{rng.randrange(4)}", 32) for _ in range(num_requests)]
    if name == "long-document":
        return [(rng.randint(1000, 3500), rng.randint(40, 200), "", 0) for _ in range(num_requests)]
    if name == "agentic":
        return _agentic(num_requests, rng)
    raise ConfigError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)} or a .jsonl trace")


def _agentic(num_requests: int, rng: random.Random) -> list[tuple[int, int, str, int]]:
    """Sessions interleave: each next request continues a random open session or opens a new one."""
    sessions: list[list[int]] = []  # [session id, context tokens, turns left]
    shapes: list[tuple[int, int, str, int]] = []
    while len(shapes) < num_requests:
        if not sessions or rng.random() < 0.3:
            sessions.append([len(shapes), rng.randint(200, 600), rng.randint(3, 8)])
        session = sessions[rng.randrange(len(sessions))]
        previous = session[1]
        prompt = previous + rng.randint(30, 120)
        output = _lognormal(rng, 60, 0.6, 8, 256)
        shapes.append((prompt, output, f"s{session[0]}", previous))
        session[1] = prompt + output
        session[2] -= 1
        if session[2] == 0:
            sessions.remove(session)
    return shapes


def synthetic(name: str, rate_per_s: float, num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """`num_requests` of workload `name` arriving Poisson at `rate_per_s`; the same seed, the same list."""
    if rate_per_s <= 0:
        raise ConfigError(f"the rate must be > 0 requests/s, got {rate_per_s}")
    if num_requests < 1:
        raise ConfigError(f"a workload needs at least one request, got {num_requests}")
    rng = random.Random(seed)
    shapes = _shapes(name, num_requests, rng)
    arrivals = random.Random(seed + 1)  # the lengths do not move when the rate does
    now = 0.0
    trace = []
    for prompt, output, group, prefix in shapes:
        trace.append(TraceRequest(now, prompt, output, group, min(prefix, prompt)))
        now += arrivals.expovariate(rate_per_s)
    return trace


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: each line must be a JSON object")
    try:
        request = TraceRequest(float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"]),
                               str(row.get("prefix_group", "")), int(row.get("prefix_tokens", 0)))
    except KeyError as exc:
        raise ConfigError(f"{where}: missing field {exc.args[0]!r} (arrival_s, prompt_tokens, output_tokens)")\
            from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if request.arrival_s < 0 or request.prompt_tokens < 1 or request.output_tokens < 1:
        raise ConfigError(f"{where}: arrival_s must be >= 0, prompt_tokens and output_tokens >= 1")
    if not 0 <= request.prefix_tokens <= request.prompt_tokens:
        raise ConfigError(f"{where}: prefix_tokens must be within 0..prompt_tokens")
    return request


def load_trace(path: Path, rate_per_s: float | None = None) -> list[TraceRequest]:
    """A JSONL trace (format in the module docstring), sorted by arrival and starting at 0."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    trace = [_parse_line(line, f"{path}:{i + 1}") for i, line in enumerate(lines) if line.strip()]
    if not trace:
        raise ConfigError(f"trace {path} holds no request")
    trace.sort(key=lambda r: r.arrival_s)
    start = trace[0].arrival_s
    span = trace[-1].arrival_s - start
    scale = 1.0
    if rate_per_s is not None:
        if rate_per_s <= 0:
            raise ConfigError(f"the rate must be > 0 requests/s, got {rate_per_s}")
        if span > 0:  # len-1 gaps over the span: the trace's own mean rate
            scale = (len(trace) - 1) / span / rate_per_s
    return [TraceRequest((r.arrival_s - start) * scale, r.prompt_tokens, r.output_tokens, r.prefix_group,
                         r.prefix_tokens) for r in trace]


def write_trace(path: Path, trace: Sequence[TraceRequest]) -> None:
    path.write_text("".join(json.dumps({"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                                        "output_tokens": r.output_tokens, "prefix_group": r.prefix_group,
                                        "prefix_tokens": r.prefix_tokens}) + "\n" for r in trace))


def workload(spec: str, rate_per_s: float | None, num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """A synthetic workload by name, or a replayed .jsonl trace."""
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return load_trace(Path(spec), rate_per_s)
    if rate_per_s is None:
        raise ConfigError(f"a synthetic workload ({spec}) needs --rate")
    return synthetic(spec, rate_per_s, num_requests, seed)
