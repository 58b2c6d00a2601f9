"""Threads that take each other's last items (`csrc/steal_for.h`, the op `work_stealing`): the projection
kernels (fp32 GEMV, bf16 GEMV below amx, the quantized GEMV, W8A8) and the paged decode kernel give each
thread a contiguous range of panels or jobs and let one done early take the others' last. Which thread runs
an item never changes what it computes, so every output is bit for bit the static split's and one thread's,
at every level this CPU runs. Five threads on this machine's cores leave items behind for the others to take;
each call runs three times, as the split differs from run to run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from shared.ops import cpu_attention
from shared.ops.cpu_kernels import cpu_kernels_available
from shared.ops.linear import LinearWeight
from shared.ops.quant import int8_per_channel, q4_1_blocks
from tests.helpers.torch_threads import torch_threads
from tests.unit.ops.conftest import AttentionBatch

THREADS = [2, 5]


@contextmanager
def stealing(on: bool) -> Iterator[None]:
    assert cpu_kernels_available(), "the C++ CPU kernels did not build (see the log)"
    previous = torch.ops.baton_cpu.work_stealing(on)
    try:
        yield
    finally:
        torch.ops.baton_cpu.work_stealing(previous)


def same_bits_every_way(run: Callable[[], torch.Tensor], threads: int) -> None:
    """run() on one thread, on `threads` split statically, and on `threads` taking, three times: all equal."""
    with torch_threads(1):
        one = run()
    with torch_threads(threads):
        with stealing(False):
            assert torch.equal(run(), one)
        with stealing(True):
            for _ in range(3):
                assert torch.equal(run(), one)


def test_taking_is_on_by_default() -> None:
    with stealing(True):
        assert torch.ops.baton_cpu.work_stealing(True) is True


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# (name, the LinearWeight, the rows it is run at): one pass and several, and for W8A8 several row blocks past
# the streamed row counts (400 rows of 1536 inputs: three blocks of 170, as 1,000 rows of 576 would make, at a
# fifteenth of the work)
PROJECTIONS: dict[str, tuple[Callable[[], LinearWeight], list[int]]] = {
    "fp32": (lambda: LinearWeight(_weight(3072, 576, 1)), [1, 13]),
    "bf16": (lambda: LinearWeight(_weight(3072, 576, 2), weight_dtype=torch.bfloat16), [1, 9, 33]),
    "q4_1": (lambda: LinearWeight.quantized(q4_1_blocks(_weight(960, 576, 3))), [1, 9]),
    "int8": (lambda: LinearWeight.quantized(int8_per_channel(_weight(3072, 576, 4))), [1, 7, 33]),
    "int8-row-blocks": (lambda: LinearWeight.quantized(int8_per_channel(_weight(192, 1536, 5))), [400]),
}
CASES = [(name, rows) for name, (_, row_counts) in PROJECTIONS.items() for rows in row_counts]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize(("kind", "rows"), CASES, ids=[f"{k}-{r}rows" for k, r in CASES])
def test_a_projection_s_bits_do_not_depend_on_who_runs_a_panel(kind: str, rows: int, threads: int,
                                                               isa_level: str) -> None:
    make, _ = PROJECTIONS[kind]
    lin = make()
    # the kernel itself, not a fallback: fp32's GEMV (up to GEMV_MAX_ROWS rows), the others' backends
    assert lin.gemv is not None if kind == "fp32" else lin.backend == {"bf16": "gemv_bf16", "q4_1": "qgemv"}.get(
        kind, "w8a8")
    x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(rows))
    same_bits_every_way(lambda: lin(x), threads)
    if kind in ("bf16", "int8"):  # gate_up with its SiLU gate, one pass over both halves
        same_bits_every_way(lambda: lin.silu_mul(x), threads)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_paged_decode_bits_do_not_depend_on_who_runs_a_job(make_batch: Callable[..., AttentionBatch],
                                                           kv_dtype: torch.dtype, threads: int,
                                                           isa_level: str) -> None:
    batch = make_batch([(context, 1) for context in (0, 7, 8, 15, 30, 61, 100, 3, 64, 17, 9)], 9, 3, 64, 16)
    batch.kv = batch.kv.to(kv_dtype)
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale)

    def attend() -> torch.Tensor:
        batch.meta.step_cache.clear()
        return cpu_attention.paged_attention_cpu(*args, None)

    same_bits_every_way(attend, threads)
