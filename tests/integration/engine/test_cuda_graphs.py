"""CUDA graphs for decode steps: the same tokens as eager launches, in both loops, no leaks.

A batch of requests of different lengths shrinks step by step through the
captured sizes (16, 8, 4, 2, 1), so rows that held a live sequence become
padding; prefill and chunked steps run eagerly in between.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine.request import SamplingParams
from tests.helpers.models import tiny_engine, tiny_loaded
from tests.integration.engine.test_engine_tiny import FAMILIES, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def shrinking_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    batch = prompts(11, seed=4, lo=3, hi=40)
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) if i % 3 else
        SamplingParams(max_tokens=6 + 2 * i, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(11)
    ]
    params[2] = SamplingParams(max_tokens=20, min_tokens=8, temperature=0.0)
    return batch, params


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "zero-bubble"])
@pytest.mark.parametrize("family", FAMILIES)
def test_graphs_give_the_eager_tokens(engines, family: str, async_scheduling: bool) -> None:
    loaded, _ = tiny_loaded(family, device="cuda")
    batch, params = shrinking_batch()
    results = {}
    for graphs in (False, True):
        engine = tiny_engine(loaded, device="cuda", cuda_graphs=graphs, async_scheduling=async_scheduling,
                             max_num_seqs=16, max_num_batched_tokens=64)
        engines.append(engine)
        results[graphs] = [r.token_ids for r in engine.generate(batch, params)]
        replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
        # Gemma 4's layer groups (its hybrid cache) replay no graphs (engine.py), by design
        assert (replays > 20) is (graphs and family != "gemma4"), replays
    assert results[True] == results[False]


def test_padding_rows_get_a_block_of_their_own(engines) -> None:
    loaded, _ = tiny_loaded("llama", device="cuda")
    engine = tiny_engine(loaded, device="cuda", num_kv_blocks=128)
    engines.append(engine)
    assert engine.num_kv_blocks == 128  # all of them for requests
    assert engine.layout.num_blocks == 129
    assert engine.runner.graphs is not None and engine.runner.graphs.scratch_block == 128
