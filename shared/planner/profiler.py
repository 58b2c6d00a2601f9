"""Measure a profile (profile.py) through the real engine: prefill and decode step times per thread count.

```
 for each torch thread count T:
   prefill sweep: batch b × prompt length L (b·L within one step's token budget), max_tokens 1:
                  the one step that computes the prompts and samples, median of `repeats`
   decode sweep:  batch B × context C: B prompts of C tokens prefilled, then `decode_steps` steps timed
 handoff sweep (profile_handoff.py): real kv_transfer, prefill and decode services in this process
```

Prompts are random token ids (no prefix hits); the engine is the one the services run (shared/engine),
built once per thread count with the same block size and token budget as a service's defaults.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import dataclass

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.planner.profile import EngineCurves

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepPlan:
    """Which points to measure; `quick()` is small enough for a test (about a minute on SmolLM2, 2 cores)."""

    threads: tuple[int, ...] = (1, 2)
    prefill_lengths: tuple[int, ...] = (16, 64, 256, 512, 1024, 2048)
    prefill_batches: tuple[int, ...] = (1, 4)
    decode_batches: tuple[int, ...] = (1, 4, 16, 32)
    decode_contexts: tuple[int, ...] = (64, 256, 1024)
    decode_steps: int = 12
    repeats: int = 3
    handoff_lengths: tuple[int, ...] = (64, 256, 1024)

    @classmethod
    def quick(cls, threads: tuple[int, ...] = (1, 2)) -> SweepPlan:
        return cls(threads=threads, prefill_lengths=(16, 128, 512), prefill_batches=(1, 4),
                   decode_batches=(1, 4, 16), decode_contexts=(64, 256), decode_steps=6, repeats=2,
                   handoff_lengths=(64, 256))


def _prompt(rng: random.Random, vocab_size: int, num_tokens: int) -> list[int]:
    return [rng.randrange(100, vocab_size) for _ in range(num_tokens)]


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def time_prefill(engine: LLMEngine, batch: int, prompt_len: int, rng: random.Random, tag: str) -> float:
    """Seconds of the one step that prefills `batch` fresh prompts of `prompt_len` tokens and samples."""
    vocab = engine.loaded.spec.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", _prompt(rng, vocab, prompt_len), params)
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    _drain(engine)  # the step finished them all (max_tokens 1); nothing is left to time
    return elapsed


def time_decode(engine: LLMEngine, batch: int, context: int, steps: int, rng: random.Random, tag: str) -> float:
    """Median seconds of one decode step of `batch` requests, each `context` tokens deep when timing starts."""
    vocab = engine.loaded.spec.vocab_size
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, _prompt(rng, vocab, context), params)
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) < 1:  # every prompt prefilled
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
    engine.step()  # one decode step of the full batch before timing (allocation of the decode shapes)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    for rid in ids:
        engine.abort(rid)
    _drain(engine)
    return statistics.median(times)


def measure_engine(engine: LLMEngine, plan: SweepPlan, seed: int = 0) -> EngineCurves:
    """The prefill and decode sweeps of `plan` on one engine at the current torch thread count."""
    rng = random.Random(seed)
    curves = EngineCurves()
    budget = engine.config.max_num_batched_tokens
    time_prefill(engine, 1, 64, rng, "warm")  # first-call costs (allocation, oneDNN packing) stay out
    for batch in plan.prefill_batches:
        for length in plan.prefill_lengths:
            if batch * length > budget:
                continue  # more than one step: the fit is per step
            # the first run of a shape pays its one-time costs (oneDNN primitives for a new M, allocation):
            # a served engine has paid them long before; timed runs come after it
            time_prefill(engine, batch, length, rng, f"p{batch}x{length}w")
            runs = [time_prefill(engine, batch, length, rng, f"p{batch}x{length}r{r}") for r in range(plan.repeats)]
            seconds = statistics.median(runs)
            curves.prefill_points.append([batch, length, batch * length, seconds])
            logger.info("profile: threads %d prefill batch %d x %d tokens: %.1f ms", torch.get_num_threads(),
                        batch, length, seconds * 1e3)
    for batch in plan.decode_batches:
        for context in plan.decode_contexts:
            seconds = time_decode(engine, batch, context, plan.decode_steps, rng, f"d{batch}x{context}")
            curves.decode_points.append([batch, context, seconds])
            logger.info("profile: threads %d decode batch %d at %d tokens of context: %.2f ms/step",
                        torch.get_num_threads(), batch, context, seconds * 1e3)
    curves.refit()
    engine.check_no_leaks()
    return curves


def measure_engines(config: EngineConfig, plan: SweepPlan, seed: int = 0) -> tuple[dict[int, EngineCurves], str]:
    """The sweeps at every thread count of `plan`, each on an engine built at that thread count (as a
    service builds its engine after setting its threads); returns them and the model's identity. Torch's
    thread count is restored."""
    before = torch.get_num_threads()
    curves: dict[int, EngineCurves] = {}
    identity = ""
    try:
        for threads in plan.threads:
            torch.set_num_threads(threads)
            logger.info("profile: loading %s for the sweeps at %d torch thread(s) ...", config.model, threads)
            engine = LLMEngine(config)
            try:
                identity = engine.loaded.identity
                curves[threads] = measure_engine(engine, plan, seed)
            finally:
                engine.close()
    finally:
        torch.set_num_threads(before)
    return curves, identity
