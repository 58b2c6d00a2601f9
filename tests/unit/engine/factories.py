"""Shared factories for engine unit tests: schedulers, requests and a fake runner.

The fake runner stands in for the model. It keeps a fake paged KV cache (one
token id per slot), so a step only "sees" what the scheduler's block tables
really hold:

    plan = scheduler.schedule()
    result = fake_execute(scheduler, plan)   # read KV [0, start_pos) from the
                                             # chunk's blocks, write the chunk's
                                             # tokens, sample next_token(history)
    outputs = scheduler.update(plan, result)

The sampled token is a pure function of the history read back from the cache,
so the same history gives the same token whatever the batch, the pool size or
the preemptions: runs that differ only in scheduling must produce equal tokens.
A wrong block (a bad prefix-cache hit, a block reused while still held) makes
the history wrong and trips an assertion with the request id and position.
"""

from __future__ import annotations

import weakref
import zlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.engine.block_pool import BlockPool
from shared.engine.kv_manager import KVCacheManager, cdiv
from shared.engine.request import Request, RequestOutput, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig, SchedulerPlan, StepResult

EOS_TOKEN_ID = 1
# fake sampled tokens live in [FAKE_TOKEN_BASE, FAKE_TOKEN_BASE + FAKE_VOCAB): never EOS, never a prompt token
FAKE_TOKEN_BASE = 100
FAKE_VOCAB = 1000
PROMPT_TOKEN_BASE = 10_000

NextTokenFn = Callable[[str, list[int]], int]


def history_token(request_id: str, all_token_ids: list[int]) -> int:
    """Default fake model: a token that depends only on the token history."""
    digest = zlib.crc32(array("q", all_token_ids).tobytes())
    return FAKE_TOKEN_BASE + digest % FAKE_VOCAB


def prompt_tokens(request_id: str, prompt_len: int) -> list[int]:
    """Distinct, deterministic prompt tokens per request id (no accidental shared prefixes)."""
    start = PROMPT_TOKEN_BASE + (zlib.crc32(request_id.encode()) % 1_000_000) * 1000
    return list(range(start, start + prompt_len))


def make_kv_manager(
    num_blocks: int = 16, block_size: int = 4, enable_prefix_caching: bool = True, hash_salt: bytes = b""
) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_prefix_caching), block_size, hash_salt=hash_salt)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    role: str = "colocated",
    enable_prefix_caching: bool = True,
    share_planned_prefixes: bool = True,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, role,
                             share_planned_prefixes=share_planned_prefixes)
    return Scheduler(config, make_kv_manager(num_blocks, block_size, enable_prefix_caching))


def make_request(
    request_id: str,
    prompt: int | Sequence[int],
    *,
    eos_token_ids: Iterable[int] = (EOS_TOKEN_ID,),
    output_token_ids: Sequence[int] = (),
    **sampling: Any,
) -> Request:
    """A request with `prompt` tokens (a length: tokens derived from the id) and SamplingParams(**sampling)."""
    prompt_token_ids = prompt_tokens(request_id, prompt) if isinstance(prompt, int) else list(prompt)
    return Request(
        request_id,
        prompt_token_ids,
        SamplingParams(**sampling),
        eos_token_ids=frozenset(eos_token_ids),
        output_token_ids=list(output_token_ids),
    )


# ---- the fake runner ------------------------------------------------------------------------------


class FakeKVCache:
    """One token id per KV slot: what a real cache's K/V would encode."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: dict[int, list[int | None]] = {}

    def read(self, request_id: str, block_ids: list[int], num_tokens: int) -> list[int]:
        history = []
        for pos in range(num_tokens):
            token = self.slots.get(block_ids[pos // self.kv.block_size], [None] * self.kv.block_size)[
                pos % self.kv.block_size
            ]
            assert token is not None, f"{request_id}: KV slot for position {pos} was never written"
            history.append(token)
        return history

    def write(self, request_id: str, block_ids: list[int], start_pos: int, token_ids: list[int]) -> None:
        block_size = self.kv.block_size
        for pos, token in enumerate(token_ids, start_pos):
            block_id = block_ids[pos // block_size]
            ref_count = self.kv.pool.blocks[block_id].ref_count
            # a block another request also references is a computed prefix: writing it would corrupt both
            assert ref_count == 1, (
                f"{request_id}: writes position {pos} into block {block_id} (refs {ref_count})"
            )
            self.slots.setdefault(block_id, [None] * block_size)[pos % block_size] = token


_FAKE_CACHES: weakref.WeakKeyDictionary[Scheduler, FakeKVCache] = weakref.WeakKeyDictionary()


def fake_kv(scheduler: Scheduler) -> FakeKVCache:
    cache = _FAKE_CACHES.get(scheduler)
    if cache is None:
        cache = _FAKE_CACHES[scheduler] = FakeKVCache(scheduler.kv)
    return cache


def inject_fake_kv(scheduler: Scheduler, request: Request) -> None:
    """Decode role: fill the request's allocated blocks with its computed tokens (what inject_kv does)."""
    block_ids = scheduler.kv.block_ids(request.request_id)
    fake_kv(scheduler).write(
        request.request_id, block_ids, 0, request.all_token_ids[: request.num_computed_tokens]
    )


def check_plan(scheduler: Scheduler, plan: SchedulerPlan) -> None:
    """Invariants every plan keeps, whatever the test."""
    config = scheduler.config
    ids = [c.request_id for c in plan.chunks]
    assert len(ids) == len(set(ids)), f"request scheduled twice: {ids}"
    assert plan.num_tokens <= config.max_num_batched_tokens, plan.num_tokens
    assert len(plan.chunks) <= config.max_num_seqs
    assert scheduler.num_running <= config.max_num_seqs
    assert not set(ids) & set(plan.preempted_ids), "a preempted request is in the plan"
    for chunk in plan.chunks:
        request = scheduler.requests[chunk.request_id]
        end = chunk.start_pos + chunk.num_tokens
        assert chunk.num_tokens >= 1
        assert end + chunk.num_draft_tokens == request.num_computed_tokens  # planning advanced it
        assert chunk.token_ids == request.all_token_ids[chunk.start_pos : end]
        assert chunk.sample == (end == request.num_tokens)
        assert chunk.block_ids == scheduler.kv.block_ids(chunk.request_id)
        assert len(chunk.block_ids) == cdiv(end, scheduler.kv.block_size), (chunk.request_id, chunk.block_ids)
    held = sum(len(t) for t in scheduler.kv.block_tables.values())
    referenced = sum(b.ref_count for b in scheduler.kv.pool.blocks)
    assert held == referenced, f"{held} table entries but {referenced} block references"
    num_unreferenced = sum(1 for b in scheduler.kv.pool.blocks if b.ref_count == 0)
    assert scheduler.kv.num_free_blocks == num_unreferenced


def fake_execute(
    scheduler: Scheduler, plan: SchedulerPlan, next_token: NextTokenFn = history_token
) -> StepResult:
    """Run a plan on the fake KV cache; sample from the history that the cache holds."""
    cache = fake_kv(scheduler)
    result = StepResult()
    for chunk in plan.chunks:
        history = cache.read(chunk.request_id, chunk.block_ids, chunk.start_pos) + chunk.token_ids
        request = scheduler.requests.get(chunk.request_id)
        if request is not None:
            assert history == request.all_token_ids[: len(history)], (
                f"{chunk.request_id}: KV holds wrong tokens"
            )
        cache.write(chunk.request_id, chunk.block_ids, chunk.start_pos, chunk.token_ids)
        if chunk.sample:
            token = next_token(chunk.request_id, history)
            while token in chunk.suppress_token_ids:  # what the sampler's mask does
                token += 1
            result.emitted[chunk.request_id] = [token]
    return result


def fake_step(
    scheduler: Scheduler, next_token: NextTokenFn = history_token
) -> tuple[SchedulerPlan, list[RequestOutput]]:
    """One engine step: schedule, run on the fake cache, update."""
    plan = scheduler.schedule()
    check_plan(scheduler, plan)
    result = fake_execute(scheduler, plan, next_token)
    return plan, scheduler.update(plan, result)


@dataclass
class RunResult:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    plans: list[SchedulerPlan] = field(default_factory=list)

    def record(self, plan: SchedulerPlan, outputs: list[RequestOutput]) -> None:
        self.plans.append(plan)
        for out in outputs:
            self.token_ids.setdefault(out.request_id, []).extend(out.new_token_ids)
            # prompt tokens served from the cache at first admission: a resume must not change them
            cached = self.num_cached_tokens.setdefault(out.request_id, out.num_cached_tokens)
            assert out.num_cached_tokens == cached, f"{out.request_id}: num_cached_tokens changed"
            if out.finished:
                assert out.finish_reason is not None
                assert out.request_id not in self.finish_reasons, f"{out.request_id} finished twice"
                self.finish_reasons[out.request_id] = out.finish_reason


def run_until_done(
    scheduler: Scheduler, next_token: NextTokenFn = history_token, max_steps: int = 1000
) -> RunResult:
    """Step until no request is waiting or running; fails on a stalled or endless run."""
    run = RunResult()
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return run
        plan, outputs = fake_step(scheduler, next_token)
        assert not plan.is_empty or plan.preempted_ids, "scheduler stalled with unfinished requests"
        run.record(plan, outputs)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def expected_tokens(
    prompt_token_ids: Sequence[int], num_tokens: int, next_token: NextTokenFn = history_token
) -> list[int]:
    """What an unbatched, unpreempted run of the fake model generates."""
    history = list(prompt_token_ids)
    for _ in range(num_tokens):
        history.append(next_token("", list(history)))
    return history[len(prompt_token_ids) :]
