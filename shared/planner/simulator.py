"""A discrete-event simulation (SimPy) of a baton fleet serving a workload, under the router's policy.

```
 arrival ─► router: pick by policy (for "kv": the router's CostModel, as services/router/routing.py scores)
   colocated:  colocated engine d: prefill (chunked) → first token → decode batch → done
   disagg:     prefill engine p: prefill (chunked) → first token sampled
                 └─ + push_s(KV bytes): reply after Commit            TTFT ends here
                    (on one host, layerwise_push: each chunk's push is part of its step, on the same cores)
               kv_transfer k (K channels): pull_s(KV bytes the decode's own prefix cache lacks)
               decode engine d: joins the running batch → tokens 2..n → done
   local prefill (disagg, local_prefill_max_tokens): a prompt whose chosen decode instance lacks at most
               that many tokens is computed there, no handoff (the router's conditional disaggregation)
```

Prefix reuse: an engine holds the leading tokens of each prefix group it served; with kv_transfer's pool
every group committed once is importable by any prefill (its bytes cost a pull). Load is read without the
router's reporting lag: the simulator's router always knows the queues.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy

from shared.errors import ConfigError
from shared.planner.profile import Profile
from shared.planner.sim_engine import ROOM_WAIT_S, Host, SimEngine, SimRequest
from shared.planner.workload import TraceRequest
from shared.registry.base import Load
from shared.registry.cost_model import CostModel, uncached_tokens
from shared.registry.kv_picker import rendezvous_weight

POLICIES = ("kv", "least_loaded", "round_robin")
# SimOptions.corun_speed's default: SmolLM2 fp32, a decode (one stream) and a prefill (256-token prompts) on one
# thread each of a 2-core Zen 5 host, together against alone (bench/results/corun-20261129-102536.json)
CORUN_SPEED = {"prefill": 0.927, "decode": 0.971}


@dataclass(frozen=True)
class Shape:
    """A fleet: `colocated` engines, or `num_prefill` + `num_decode` engines and `num_kv` kv_transfers."""

    num_prefill: int
    num_decode: int
    num_kv: int = 1
    colocated: bool = False

    def __post_init__(self) -> None:
        if self.num_decode < 1 or (not self.colocated and (self.num_prefill < 1 or self.num_kv < 1)):
            raise ConfigError(f"a fleet needs at least one of each service, got {self}")

    @property
    def num_engines(self) -> int:
        return self.num_decode + (0 if self.colocated else self.num_prefill)

    def describe(self) -> str:
        if self.colocated:
            return f"{self.num_decode} colocated"
        return f"{self.num_prefill}P{self.num_decode}D{self.num_kv}K"


@dataclass(frozen=True)
class SimOptions:
    policy: str = "kv"
    cores: int | None = None  # one host of this many cores shared by every engine; None: separate machines
    threads_per_engine: int | None = None  # None: cores // engines (as `baton up`), else the profile's largest
    # on one host (cores set, threads_per_engine None): engines take every core while the others have no work,
    # as `baton up` runs them (shared/engine/core_share.py); False: cores // engines always (--no-core-share)
    core_share: bool = True
    local_prefill_max_tokens: int = 0  # the router's setting (-1: the cost model's break-even)
    router_overhead_s: float = 0.0  # added to every request's first token (HTTP, tokenization, gRPC)
    # kv policy: a prompt's prefix counts as held by the engine it was sent to from that moment on, as the
    # router remembers what it sent where (shared/registry/routed_prefixes.py); False: once computed there
    routed_memory: bool = True
    # an oversubscribed host: a multi-thread step's speed against processor sharing's (sim_engine.py `Host`);
    # 0.42 = 0.28 / 0.67, a 2-thread team beside a 1-thread one (bench/results/omp_contention-20261126-200252.json)
    team_speed: float = 0.42
    # lent cores: an engine that gets work waits this long at most for a neighbour's step on more threads than
    # its share to end or shrink (shared/engine/core_share.py ROOM_WAIT_S); 0: it steps beside it at once, as
    # the services did before 2026-11-29
    room_wait_s: float = ROOM_WAIT_S
    # one host's engines stepping at once, each on cores of its own: each step's speed by kind ("prefill",
    # "decode") against alone, from the memory bus and cache they share (bench/corun.py); {}: no effect
    corun_speed: dict[str, float] = field(default_factory=lambda: dict(CORUN_SPEED))
    # on one host (cores set): a prefill engine pushes each chunk's KV while it computes it (the services'
    # layer-wise push, shared/engine/remote_kv.py) on the same cores, so the push's time is part of the step
    # and the handoff after it is the pull alone; a prompt queued behind another waits for that push too. In a
    # 1P1D run (plan_validate-20261129-124828) a 229-token prompt alone on 2 threads took 184 ms of prefill
    # with its push against 110 predicted, and a 256-token one arriving 3 ms after it started prefill only
    # when that push was over. False, or machines of their own: the push after the step, beside the engine's
    # next (RDMA does not take the engine's cores)
    layerwise_push: bool = True
    # None: the router's own CostModel() (what services/router scores with today). Profile.cost_model's measured
    # coefficients are not the default: on the H100 profile a decode request's measured step cost is ~0, so
    # prefix affinity outweighs load and every request of a system prompt lands on one decode (4 of 11 busy)
    cost_model: CostModel | None = None


class Fleet:
    """The engines of one shape on one SimPy environment, and the router's picks between them."""

    def __init__(self, env: simpy.Environment, profile: Profile, shape: Shape, options: SimOptions) -> None:
        if options.policy not in POLICIES:
            raise ConfigError(f"routing policy must be one of {POLICIES}, got {options.policy!r}")
        self.env, self.profile, self.shape, self.options = env, profile, shape, options
        host = Host(options.cores, options.team_speed, options.corun_speed)
        threads = options.threads_per_engine or (
            max(1, options.cores // shape.num_engines) if options.cores else max(profile.engines))
        curves = profile.curves(threads)
        lend = options.core_share and options.cores is not None and options.threads_per_engine is None \
            and shape.num_engines > 1
        curves_at = profile.curves if lend else None
        self.cost_model = options.cost_model or CostModel()
        limits = (profile.max_num_seqs, profile.max_num_batched_tokens)
        role = "colocated" if shape.colocated else "decode"
        self.decodes = [SimEngine(env, f"decode-{i}", role, curves, threads, host, limits, curves_at,
                                  options.room_wait_s) for i in range(shape.num_decode)]
        self.push_in_step = options.layerwise_push and options.cores is not None
        push_s = (lambda tokens: profile.handoff.push_s(tokens * profile.kv_bytes_per_token)) \
            if self.push_in_step else None
        self.prefills = [] if shape.colocated else [
            SimEngine(env, f"prefill-{i}", "prefill", curves, threads, host, limits, curves_at, options.room_wait_s,
                      push_s)
            for i in range(shape.num_prefill)]
        for engine in self.decodes:
            engine.on_prefilled = self._first_token_on(engine)
        for engine in self.prefills:
            engine.on_prefilled = self._handoff
        self.kv = simpy.Resource(env, capacity=max(1, shape.num_kv))
        self.pool_groups: dict[str, int] = {}  # kv_transfer's prefix pool: group -> leading tokens committed
        self.sent_groups: dict[str, dict[str, int]] = {}  # engine -> group -> leading tokens the router sent it
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        self.num_local_prefills = 0

    # ---- the router's picks ----------------------------------------------------------------------
    def _hit_tokens(self, groups: dict[str, int], request: SimRequest) -> int:
        if not request.prefix_group:
            return 0
        held = min(groups.get(request.prefix_group, 0), request.prefix_tokens)
        return held // self.profile.block_size * self.profile.block_size

    def _own_hit_tokens(self, engine: SimEngine, request: SimRequest) -> int:
        """What the router counts as held by `engine`'s own cache: what it computed, or was sent."""
        held = self._hit_tokens(engine.prefix_groups, request)
        if not self.options.routed_memory:
            return held
        return max(held, self._hit_tokens(self.sent_groups.get(engine.name, {}), request))

    def _sent(self, engine: SimEngine, request: SimRequest) -> SimEngine:
        if request.prefix_group:
            groups = self.sent_groups.setdefault(engine.name, {})
            groups[request.prefix_group] = max(groups.get(request.prefix_group, 0), request.prompt_tokens)
        return engine

    def _load(self, engine: SimEngine) -> Load:
        return Load(num_running=len(engine.running), num_waiting=len(engine.waiting))

    def _pick(self, service: str, engines: Sequence[SimEngine], cost: object, request: SimRequest) -> SimEngine:
        if self.options.policy == "round_robin":
            return engines[next(self._turns[service]) % len(engines)]
        if self.options.policy == "least_loaded":
            return min(engines, key=lambda e: (e.num_requests, e.name))
        # equal costs as the router breaks them (kv_picker.py): rendezvous on the prompt's opening
        return min(engines, key=lambda e: (cost(e), -self._affinity(e, request), e.name))  # type: ignore[operator]

    @staticmethod
    def _affinity(engine: SimEngine, request: SimRequest) -> int:
        return rendezvous_weight(request.prefix_group, engine.name) if request.prefix_group else 0

    def _pick_decode(self, request: SimRequest, pulls: bool) -> SimEngine:
        model, block = self.cost_model, self.profile.block_size

        def cost(engine: SimEngine) -> float:
            hits = self._own_hit_tokens(engine, request)
            if not pulls:
                return model.local_prefill_s(uncached_tokens(request.prompt_tokens, hits // block, block),
                                             self._load(engine))
            return model.decode_s(self._load(engine), 0, max(0, (request.prompt_tokens - hits) // block))
        return self._pick("decode", self.decodes, cost, request)  # the caller records it when it sends

    def _pick_prefill(self, request: SimRequest) -> SimEngine:
        model, block = self.cost_model, self.profile.block_size

        def cost(engine: SimEngine) -> float:
            own = self._own_hit_tokens(engine, request)
            pooled = self._hit_tokens(self.pool_groups, request)
            return model.prefill_s(uncached_tokens(request.prompt_tokens, max(own, pooled) // block, block),
                                   self._load(engine), 0, max(0, pooled - own) // block)
        return self._pick("prefill", self.prefills, cost, request)

    def _local_threshold(self) -> int:
        setting = self.options.local_prefill_max_tokens
        return self.cost_model.break_even_tokens(self.profile.block_size) if setting == -1 else setting

    # ---- a request's path --------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> None:
        if self.shape.colocated:
            self._prefill_on(self._pick_decode(request, pulls=False), request)
            return
        if self.options.local_prefill_max_tokens != 0:  # the router asks the decode it would pick first
            decode = self._pick_decode(request, pulls=False)
            local_todo = request.prompt_tokens - self._hit_tokens(decode.prefix_groups, request)
            if local_todo <= self._local_threshold():
                self.num_local_prefills += 1
                self._prefill_on(decode, request)
                return
        prefill = self._sent(self._pick_prefill(request), request)
        own = self._hit_tokens(prefill.prefix_groups, request)
        pooled = self._hit_tokens(self.pool_groups, request)
        request.cached_tokens = min(max(own, pooled), request.prompt_tokens - 1)
        if pooled > own:  # prefill reads the pool's blocks before computing the rest
            self.env.process(self._import_then_prefill(prefill, request, pooled - own))
        else:
            prefill.add_prompt(request)

    def _prefill_on(self, engine: SimEngine, request: SimRequest) -> None:
        self._sent(engine, request)
        request.cached_tokens = min(self._hit_tokens(engine.prefix_groups, request), request.prompt_tokens - 1)
        engine.add_prompt(request)

    def _import_then_prefill(self, prefill: SimEngine, request: SimRequest, num_tokens: int):  # type: ignore[no-untyped-def]
        yield self.env.timeout(self.profile.handoff.pull_s(num_tokens * self.profile.kv_bytes_per_token))
        prefill.add_prompt(request)

    def _first_token_on(self, engine: SimEngine):  # type: ignore[no-untyped-def]
        def first_token(request: SimRequest) -> None:
            self._emit_first(request)
            if request.done:
                engine.on_finished(request)
            else:
                engine.running.append(request)
        return first_token

    def _emit_first(self, request: SimRequest) -> None:
        request.first_token_s = self.env.now + self.options.router_overhead_s
        request.token_times_s.append(request.first_token_s)

    def _handoff(self, request: SimRequest) -> None:
        self.env.process(self._handoff_process(request))

    def _handoff_process(self, request: SimRequest):  # type: ignore[no-untyped-def]
        handoff = self.profile.handoff
        if not self.push_in_step:  # else it was pushed as its prefill steps ran
            yield self.env.timeout(handoff.push_s(request.prompt_tokens * self.profile.kv_bytes_per_token))
        self._emit_first(request)
        if request.prefix_group:  # committed full blocks stay in the pool
            held = self.pool_groups.get(request.prefix_group, 0)
            self.pool_groups[request.prefix_group] = max(held, request.prompt_tokens)
        if request.done:
            return
        decode = self._sent(self._pick_decode(request, pulls=True), request)  # bound after prefill, as the router
        missing = request.prompt_tokens - self._hit_tokens(decode.prefix_groups, request)
        with self.kv.request() as channel:
            yield channel
            yield self.env.timeout(handoff.pull_s(missing * self.profile.kv_bytes_per_token))
        request.pulled = True
        if request.prefix_group:
            held = decode.prefix_groups.get(request.prefix_group, 0)
            decode.prefix_groups[request.prefix_group] = max(held, request.prompt_tokens)
        decode.add_decoding(request)


def simulate(profile: Profile, shape: Shape, trace: Sequence[TraceRequest],
             options: SimOptions | None = None) -> list[SimRequest]:
    """Run `trace` through a fleet of `shape`; every request's timings, in trace order."""
    options = options or SimOptions()
    env = simpy.Environment()
    fleet = Fleet(env, profile, shape, options)
    requests = [SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens, r.prefix_group, r.prefix_tokens)
                for i, r in enumerate(trace)]

    def arrivals():  # type: ignore[no-untyped-def]
        for request in requests:
            yield env.timeout(max(0.0, request.arrival_s - env.now))
            fleet.submit(request)
    env.process(arrivals())
    env.run()
    unfinished = [r.index for r in requests if not r.done]
    assert not unfinished, f"requests {unfinished[:5]} never finished"  # the loop drains every queue
    return requests
