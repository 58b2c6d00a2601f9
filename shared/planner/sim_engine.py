"""One engine instance in the simulator: the step loop of shared/engine, with step times from a profile.

```
 loop:  wait for work
        plan:  every running request decodes one token (up to max_num_seqs), then the waiting
               prompts are chunked FCFS into what is left of the step's token budget
        time:  EngineCurves.mixed_step_s(prefill tokens, batch, its context) (+ the chunks' KV push, for a
               prefill engine that pushes within its steps) × CPU contention
        update: a prompt whose last chunk ran samples its first token → on_prefilled(request)
               (prefill role: the handoff; otherwise it joins the running batch);
               each decoded request gets a token, and leaves at its output length
```

CPU contention (`Host`): engines sharing `cores` cores share them as the OS would (processor sharing):
while the engines with work (queued or running) have more threads between them than there are cores,
every step in progress runs at cores / those threads of its full speed, re-rated whenever an engine
starts or runs out of work. A step on a team of several threads runs slower still (`team_speed` of that):
each of its ops ends at an OpenMP barrier that waits for the team's descheduled thread (bench/
omp_contention.py: a 2-thread team beside a 1-thread process ran at 0.28 of alone where processor sharing
gives 0.67). A fleet of separate machines has no host and no contention.

Lent cores (`baton up`'s core share, shared/engine/core_share.py): with `curves_at` given, each step runs
on max(its share, cores // the host's engines with work) threads, timed by the profile's curves at that
count, as the engine picks its thread count before each step; a step of LONG_STEP_TOKENS or more picks it
again whenever another engine gets work or runs out of it, as the engine does between its layers. An engine
that gets work waits (using no core, at most `room_wait_s`) while a neighbour's step in progress runs more
threads than its share now allows, as the core share's newcomer does: a short step ends first, a long one
shrinks at its next layer (here at once).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from shared.planner.profile import EngineCurves

LONG_STEP_TOKENS = 64  # shared/engine/engine.py's _LONG_STEP_TOKENS: such steps refit their threads mid-step
ROOM_WAIT_S = 0.25  # shared/engine/core_share.py's: the longest a newcomer waits for a neighbour to shrink


@dataclass
class SimRequest:
    """One request's state and timings (seconds of simulated time)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: str = ""
    prefix_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a prefix cache (or the pool) supplied: not computed
    prefilled_tokens: int = 0
    first_token_s: float = -1.0
    token_times_s: list[float] = field(default_factory=list)  # every output token, the first included
    pulled: bool = False  # decode: its KV came by handoff

    @property
    def num_to_compute(self) -> int:
        return self.prompt_tokens - self.cached_tokens - self.prefilled_tokens

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + len(self.token_times_s)

    @property
    def done(self) -> bool:
        return len(self.token_times_s) >= self.output_tokens


class Host:
    """Cores shared by the engines of one machine; `None` cores: each engine has its own."""

    def __init__(self, cores: int | None, team_speed: float = 1.0,
                 corun_speed: dict[str, float] | None = None) -> None:
        self.cores = cores
        self.team_speed = team_speed  # of processor sharing's speed, for a team of 2+ threads oversubscribed
        # a step's speed (by kind: "prefill", "decode") while another engine of the host steps too, on cores
        # of its own: what they share is the memory bus and the last-level cache (bench/corun.py)
        self.corun_speed = corun_speed or {}
        self.active_threads = 0  # of the engines that have work
        self.busy_engines = 0  # engines that have work
        self.stepping: set[simpy.Process] = set()  # engines in the middle of a step
        self._rerated: simpy.Event | None = None  # what the steps in progress wait on beside their end
        self.engines: list[SimEngine] = []  # every engine on this host

    def speed(self, threads: int = 1, kind: str = "decode") -> float:
        """The share of full speed a step of `kind` on `threads` threads runs at now."""
        if self.cores is None:
            return 1.0
        corun = self.corun_speed.get(kind, 1.0) if len(self.stepping) > 1 else 1.0
        if self.active_threads <= self.cores:
            return corun
        shared = self.cores / self.active_threads
        return corun * (shared * self.team_speed if threads > 1 else shared)

    def change(self, threads: int) -> None:
        """An engine with `threads` threads got work (> 0) or ran out of it (< 0): re-rate running steps."""
        self.active_threads += threads
        self._rerate()

    def _rerate(self) -> None:
        """Wake the steps in progress to take their speed again (an event, not an interrupt: a step that
        ends at the same instant must not find a stray interrupt in its engine's next wait)."""
        if self._rerated is not None and not self._rerated.triggered:
            self._rerated.succeed()

    def run_step(self, env: simpy.Environment, process: simpy.Process, work_s: float, threads: int = 1,
                 refit: Callable[[], tuple[int, float]] | None = None,
                 kind: str = "decode") -> Generator[Any, Any, None]:
        """Hold the caller for a step of `work_s` seconds of full-speed work at the speed of the moment.
        `refit`: the step takes its thread count again at each re-rate (a long step on lent cores, as
        core_share.py reads it between layers); it returns the count and the whole step's time on it.
        `kind`: "prefill" or "decode", for the co-running speed."""
        if work_s <= 0.0:
            return
        if self.cores is None:  # machines of their own: nothing re-rates a step
            yield env.timeout(work_s)
            return
        self.stepping.add(process)
        if self.corun_speed and len(self.stepping) == 2:
            self._rerate()  # the other one now runs beside this step
        try:
            done = 0.0  # fraction of the step
            while done < 1.0 - 1e-12:
                if self._rerated is None or self._rerated.triggered:
                    self._rerated = env.event()
                rerated = self._rerated
                speed, started = self.speed(threads, kind), env.now
                timeout = env.timeout((1.0 - done) * work_s / speed)
                yield timeout | rerated
                if timeout.processed:  # the rest of the step's work is done (a re-rate may fall at its end)
                    done = 1.0
                    continue
                done += (env.now - started) * speed / work_s
                if refit is not None:
                    threads, work_s = refit()
        finally:
            self.stepping.discard(process)
            if self.corun_speed and len(self.stepping) == 1:
                self._rerate()  # the one left runs alone now


class SimEngine:
    """An engine's step loop as a SimPy process (see the module docstring)."""

    def __init__(self, env: simpy.Environment, name: str, role: str, curves: EngineCurves, threads: int,
                 host: Host, limits: tuple[int, int],
                 curves_at: Callable[[int], EngineCurves] | None = None, room_wait_s: float = ROOM_WAIT_S,
                 push_s: Callable[[int], float] | None = None) -> None:
        """`push_s`: a prefill engine that pushes each chunk's KV within its step (the seconds for so many
        tokens' KV, added to the step's work); None: nothing but the curves' step time."""
        self.env, self.name, self.role, self.curves = env, name, role, curves
        self.threads, self.host = threads, host  # `threads`: its share
        host.engines.append(self)
        self.room_wait_s = room_wait_s
        self.push_s = push_s
        self.stepping_threads = 0  # threads of the step in progress (0: none)
        self._shrunk = env.event()  # succeeds when the step in progress ends or runs on fewer threads
        self.curves_at = curves_at  # lent cores: the curves at each thread count (None: `threads` always)
        self.max_num_seqs, self.max_num_batched_tokens = limits
        self.waiting: deque[SimRequest] = deque()  # prompts still to compute
        self.running: list[SimRequest] = []  # decoding
        self.on_prefilled: Callable[[SimRequest], None] = self._start_decoding
        self.on_finished: Callable[[SimRequest], None] = lambda request: None
        self.prefix_groups: dict[str, int] = {}  # group -> leading tokens this engine's prefix cache holds
        self._wake = env.event()
        self.busy_s = 0.0
        self.held = 0  # threads this engine counts on the host now (0: no work)
        self._hold(threads)  # until the loop first finds nothing to do
        self.process = env.process(self._loop())

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def queued_tokens(self) -> int:
        return sum(r.num_to_compute for r in self.waiting)

    def add_prompt(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self._poke()

    def add_decoding(self, request: SimRequest) -> None:
        self.running.append(request)
        self._poke()

    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _start_decoding(self, request: SimRequest) -> None:
        self.running.append(request)

    def _plan(self) -> tuple[list[SimRequest], list[tuple[SimRequest, int]]]:
        batch = self.running[: self.max_num_seqs]
        budget = self.max_num_batched_tokens - len(batch)
        chunks: list[tuple[SimRequest, int]] = []
        for request in self.waiting:
            if budget <= 0 or len(batch) + len(chunks) >= self.max_num_seqs:
                break
            take = min(budget, request.num_to_compute)
            chunks.append((request, take))
            budget -= take
        return batch, chunks

    def _hold(self, threads: int) -> None:
        """Count `threads` of this engine on the host (0: it has no work)."""
        if threads == self.held:
            return
        self.host.busy_engines += (threads > 0) - (self.held > 0)
        held, self.held = self.held, threads
        self.host.change(threads - held)

    def _step_threads(self) -> int:
        if self.curves_at is None or self.host.cores is None:
            return self.threads
        others = self.host.busy_engines - (self.held > 0)
        return max(self.threads, self.host.cores // (1 + others))

    def _refit(self, curves_at: Callable[[int], EngineCurves], num_prefill: int, batch: int,
               context: int, push_s: float) -> Callable[[], tuple[int, float]]:
        def refit() -> tuple[int, float]:
            threads = self._step_threads()
            self._hold(threads)
            self._stepping_on(threads)
            return threads, curves_at(threads).mixed_step_s(num_prefill, batch, context) + push_s
        return refit

    def _stepping_on(self, threads: int) -> None:
        """The step in progress runs on `threads` now (0: it ended); wakes newcomers waiting for it to shrink."""
        shrunk = threads < self.stepping_threads
        self.stepping_threads = threads
        if shrunk:
            event, self._shrunk = self._shrunk, self.env.event()
            event.succeed()

    def _crowding(self) -> list[SimEngine]:
        """Neighbours whose step in progress runs more threads than their share allows now."""
        fair = (self.host.cores or 0) // max(1, self.host.busy_engines)
        return [e for e in self.host.engines if e is not self and e.stepping_threads > max(e.threads, fair)]

    def _wait_for_room(self, threads: int) -> Generator[Any, Any, None]:
        """Before a step: wait, using no core, until no neighbour runs more than its share (core_share.py)."""
        crowding = self._crowding()
        if not crowding or self.room_wait_s <= 0:
            return
        deadline = self.env.now + self.room_wait_s
        self.host.change(-threads)  # asleep meanwhile: busy (neighbours shrink for it) but on no core
        try:
            while crowding and self.env.now < deadline:
                yield simpy.AnyOf(self.env, [e._shrunk for e in crowding] + [self.env.timeout(deadline - self.env.now)])
                crowding = self._crowding()
        finally:
            self.host.change(threads)

    def _loop(self) -> Generator[Any, Any, None]:
        while True:
            if not self.waiting and not self.running:
                self._hold(0)
                self._wake = self.env.event()
                yield self._wake
                self._hold(self.threads)
                continue
            threads = self._step_threads()
            self._hold(threads)
            if self.curves_at is not None:
                yield from self._wait_for_room(threads)
                threads = self._step_threads()  # what the neighbours' shrinking left it
                self._hold(threads)
            curves = self.curves if self.curves_at is None else self.curves_at(threads)
            batch, chunks = self._plan()
            num_prefill = sum(n for _, n in chunks)
            context = sum(r.context_tokens for r in batch)
            push_s = sum(self.push_s(n) for _, n in chunks) if self.push_s is not None else 0.0
            started = self.env.now
            refit = None
            if self.curves_at is not None and num_prefill + len(batch) >= LONG_STEP_TOKENS:
                refit = self._refit(self.curves_at, num_prefill, len(batch), context, push_s)
            self._stepping_on(threads)
            try:
                yield from self.host.run_step(self.env, self.process,
                                              curves.mixed_step_s(num_prefill, len(batch), context) + push_s,
                                              threads, refit, "prefill" if num_prefill else "decode")
            finally:
                self._stepping_on(0)
            self.busy_s += self.env.now - started
            self._finish_step(batch, chunks)

    def _finish_step(self, batch: list[SimRequest], chunks: list[tuple[SimRequest, int]]) -> None:
        now = self.env.now
        for request in batch:
            request.token_times_s.append(now)
            if request.done:
                self.running.remove(request)
                self.on_finished(request)
        for request, num_tokens in chunks:
            request.prefilled_tokens += num_tokens
            if request.num_to_compute <= 0:
                self.waiting.remove(request)
                if request.prefix_group:
                    held = self.prefix_groups.get(request.prefix_group, 0)
                    self.prefix_groups[request.prefix_group] = max(held, request.prompt_tokens)
                self.on_prefilled(request)
