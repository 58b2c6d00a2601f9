"""A performance profile: what one instance of each service costs on one machine, measured by `baton profile`.

```
 profile.json
   model    {name, identity}             what was measured; a plan for another model is refused
   machine  {cores, isa, cpu}            where; a simulation of this host from another one is refused
   engines  {"<torch threads>": {        one engine process at that thread count
              prefill_points [[batch, prompt_len, step_tokens, seconds_per_step] ...]
              decode_points  [[batch, context_per_request, seconds_per_step] ...]
              prefill_fit    [a, b, c]   step_s(n tokens)         = a + b n + c n²
              decode_fit     [a, b, c]}} step_s(batch B, ctx C)   = a + b B + c C   (C: context of the batch)
                                         the simulator interpolates decode_points by batch size instead
                                         (EngineCurves.decode_lines); the fit stands where it cannot
   handoff  {transport, points [[nbytes, push_s, pull_s] ...],
             push_fit [a, b], pull_fit [a, b]}                    s(nbytes) = a + b nbytes
```

`push_s` is what a prefill service's reply takes beyond the engine's own prefill compute (the layer-wise
writes into kv_transfer, Reserve and Commit); `pull_s` is what decode's first token takes beyond its own
decode step (the claim, the read of the same bytes, the call). Profiles before 2026-11-27 hold the read alone
there (4 and 9 ms less at 64 and 256 tokens on 2 cores); the format is the same.
The fits are least squares over the points, clamped non-negative, so the simulator can ask any size.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.registry.cost_model import CostModel

PROFILE_VERSION = 1
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")  # what steers our CPU kernels


@dataclass(frozen=True)
class MachineShape:
    """What a profile's timings depend on beyond the model: cores and the instruction sets the kernels use."""

    cores: int
    isa: tuple[str, ...]
    cpu: str = ""  # the CPU's model name, for the reader; not compared

    @classmethod
    def this_machine(cls) -> MachineShape:
        flags: set[str] = set()
        cpu = platform.processor()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "flags" and not flags:
                    flags = set(value.split())
                elif key.strip() == "model name" and value.strip():
                    cpu = value.strip()
        except OSError:  # not Linux: cores only
            pass
        return cls(os.cpu_count() or 1, tuple(f for f in ISA_FLAGS if f in flags), cpu)

    def difference(self, other: MachineShape) -> str:
        """Why `other` is not this shape ('' when it is)."""
        if self.cores != other.cores:
            return f"{self.cores} cores against {other.cores}"
        if self.isa != other.isa:
            return f"instruction sets {'+'.join(self.isa) or 'none'} against {'+'.join(other.isa) or 'none'}"
        return ""


def fit_linear(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Least-squares coefficients of targets ≈ rows @ coef, each clamped at >= 0 (costs never fall with size)."""
    if len(rows) < len(rows[0]):
        raise ConfigError(f"a fit of {len(rows[0])} coefficients needs at least as many points, got {len(rows)}")
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(targets, dtype=float), rcond=None)
    return [max(0.0, float(c)) for c in coef]


@dataclass
class EngineCurves:
    """One engine process's step times at one torch thread count."""

    prefill_points: list[list[float]] = field(default_factory=list)  # [batch, prompt_len, step_tokens, s/step]
    decode_points: list[list[float]] = field(default_factory=list)  # [batch, context per request, s/step]
    prefill_fit: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    decode_fit: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    def refit(self) -> None:
        self.prefill_fit = fit_linear([[1.0, p[2], p[2] ** 2] for p in self.prefill_points],
                                      [p[3] for p in self.prefill_points])
        self.decode_fit = fit_linear([[1.0, p[0], p[0] * p[1]] for p in self.decode_points],
                                     [p[2] for p in self.decode_points])

    def prefill_step_s(self, num_tokens: int) -> float:
        a, b, c = self.prefill_fit
        return a + b * num_tokens + c * num_tokens * num_tokens

    def decode_step_s(self, batch: int, num_context_tokens: int) -> float:
        """A decode step of `batch` requests holding `num_context_tokens` KV tokens between them: between the
        measured batch sizes (decode_lines), or the fit where fewer than two were measured."""
        key = (id(self.decode_points), len(self.decode_points), tuple(self.decode_fit))
        cached = self.__dict__.get("_decode_lines")  # not a field: to_json (asdict) leaves it out
        if cached is None or cached[0] != key:
            cached = self.__dict__["_decode_lines"] = (key, self.decode_lines())  # the simulator asks every step
        lines = cached[1]
        if lines is None:
            a, b, c = self.decode_fit
            return a + b * batch + c * num_context_tokens
        return interpolated_decode_s(lines, batch, num_context_tokens)

    def decode_lines(self) -> list[list[float]] | None:
        """[[batch, a, c] ...] by batch size: that batch's steps as a + c x (the batch's context), least squares
        over its measured contexts. One plane over every batch (decode_fit) misses batch 1 by 12-17% on 2
        cores (a step's cost grows little from 1 to 4 requests, then by each): the workloads there run at
        batches of 1-4. None when fewer than two batch sizes were measured."""
        by_batch: dict[int, list[list[float]]] = {}
        for batch, per_request, seconds in self.decode_points:
            by_batch.setdefault(int(batch), []).append([batch * per_request, seconds])
        if len(by_batch) < 2:
            return None
        lines = []
        for batch, rows in sorted(by_batch.items()):
            if len({ctx for ctx, _ in rows}) < 2:  # one context: the plane's context cost through the point
                c = self.decode_fit[2]
                lines.append([float(batch), max(0.0, rows[0][1] - c * rows[0][0]), c])
            else:
                a, c = fit_linear([[1.0, ctx] for ctx, _ in rows], [sec for _, sec in rows])
                lines.append([float(batch), a, c])
        return lines

    def mixed_step_s(self, num_prefill_tokens: int, batch: int, num_context_tokens: int) -> float:
        """A step that prefills a chunk and decodes a batch: both parts, the fixed cost once."""
        if num_prefill_tokens <= 0:
            return self.decode_step_s(batch, num_context_tokens) if batch else 0.0
        if batch <= 0:
            return self.prefill_step_s(num_prefill_tokens)
        return (self.prefill_step_s(num_prefill_tokens + batch) + self.decode_fit[2] * num_context_tokens)


def interpolated_decode_s(lines: Sequence[Sequence[float]], batch: int, num_context_tokens: int) -> float:
    """A decode step from EngineCurves.decode_lines: each neighbouring measured batch size's line at the same
    context per request, linear in the batch size between them (the last two past the largest, the first
    below the smallest). Restated in bench/vidur_driver.py, which runs where baton is not installed."""
    if batch <= 0:
        return 0.0
    per_request = num_context_tokens / batch
    k = 0
    while k < len(lines) - 2 and batch > lines[k + 1][0]:
        k += 1
    (b0, a0, c0), (b1, a1, c1) = lines[k], lines[k + 1]
    s0, s1 = a0 + c0 * b0 * per_request, a1 + c1 * b1 * per_request
    if batch <= b0:
        return a0 + c0 * num_context_tokens
    return max(0.0, s0 + (s1 - s0) * (batch - b0) / (b1 - b0))


@dataclass
class HandoffCurves:
    transport: str = ""
    points: list[list[float]] = field(default_factory=list)  # [nbytes, push_s, pull_s]
    push_fit: list[float] = field(default_factory=lambda: [0.0, 0.0])
    pull_fit: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def refit(self) -> None:
        rows = [[1.0, p[0]] for p in self.points]
        self.push_fit = fit_linear(rows, [p[1] for p in self.points])
        self.pull_fit = fit_linear(rows, [p[2] for p in self.points])

    def push_s(self, nbytes: int) -> float:
        return self.push_fit[0] + self.push_fit[1] * nbytes

    def pull_s(self, nbytes: int) -> float:
        return self.pull_fit[0] + self.pull_fit[1] * nbytes


@dataclass
class Profile:
    model: str  # the alias or path the profile was taken with
    model_identity: str  # LoadedModel.identity: architecture and KV shapes
    machine: MachineShape
    block_size: int
    kv_bytes_per_token: int  # KV (and hidden-state) bytes a handoff moves per prompt token
    max_num_batched_tokens: int
    max_num_seqs: int
    engines: dict[int, EngineCurves]  # torch threads -> curves
    handoff: HandoffCurves
    created: str = ""
    notes: str = ""  # e.g. "roofline estimate, not measured"

    def curves(self, threads: int) -> EngineCurves:
        """The curves measured at `threads`, else the nearest thread count measured."""
        if threads in self.engines:
            return self.engines[threads]
        nearest = min(self.engines, key=lambda t: (abs(t - threads), -t))
        return self.engines[nearest]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["version"] = PROFILE_VERSION
        out["machine"]["isa"] = list(self.machine.isa)
        out["engines"] = {str(t): asdict(c) for t, c in sorted(self.engines.items())}
        return out

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "profile") -> Profile:
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            version = data.get("version") if isinstance(data, dict) else None
            raise ConfigError(f"{source}: not a baton profile of version {PROFILE_VERSION} (version {version!r})")
        try:
            engines = {int(t): EngineCurves(**c) for t, c in data["engines"].items()}
            if not engines:
                raise ConfigError(f"{source}: the profile measured no engine")
            machine = data["machine"]
            return cls(
                model=str(data["model"]), model_identity=str(data["model_identity"]),
                machine=MachineShape(int(machine["cores"]), tuple(machine["isa"]), str(machine.get("cpu", ""))),
                block_size=int(data["block_size"]), kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                max_num_batched_tokens=int(data["max_num_batched_tokens"]), max_num_seqs=int(data["max_num_seqs"]),
                engines=engines, handoff=HandoffCurves(**data["handoff"]), created=str(data.get("created", "")),
                notes=str(data.get("notes", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: malformed profile ({type(exc).__name__}: {exc})") from exc

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"profile {path} is not JSON: {exc}") from exc
        return cls.from_json(data, str(path))

    def cost_model(self, threads: int) -> CostModel:
        """The router's cost model (shared/registry/cost_model.py) with this profile's measured coefficients:
        what the router would score with on these machines, and what the simulated router scores with."""
        curves, handoff = self.curves(threads), self.handoff
        block_bytes = self.kv_bytes_per_token * self.block_size
        return CostModel(
            prefill_s_per_token=max(curves.prefill_fit[1], 1e-9),
            decode_s_per_request=max(curves.decode_fit[1], 1e-9),
            transfer_s_per_block=handoff.pull_fit[1] * block_bytes,
            handoff_overhead_s=handoff.push_fit[0] + handoff.pull_fit[0],
        )

    def check_model(self, model: str) -> None:
        """Refuse a plan for another model than the one measured."""
        if model != self.model:
            raise ConfigError(f"the profile was measured with model {self.model!r} ({self.model_identity}), "
                              f"not {model!r}: run `baton profile --model {model}` first")

    def check_machine(self, machine: MachineShape) -> None:
        """Refuse to stand for `machine` when it is not the shape measured."""
        why = self.machine.difference(machine)
        if why:
            raise ConfigError(f"the profile was measured on another machine shape ({why}): "
                              f"run `baton profile` on this machine")
