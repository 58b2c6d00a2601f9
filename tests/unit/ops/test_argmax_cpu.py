"""The CPU argmax over logits' rows (`csrc/argmax_cpu.cpp`) against torch.argmax: the same index for every
row, ties (the first), NaN (the first NaN), infinities, signed zeros, and lengths off the 16-lane grid, at
every instruction-set level this CPU runs (below avx512 the op is torch's own)."""

from __future__ import annotations

import pytest
import torch

from shared.ops.argmax_cpu import argmax_rows
from tests.helpers.torch_threads import torch_threads


def check(x: torch.Tensor) -> None:
    out = torch.ops.baton_cpu.argmax_rows(x)
    assert out.dtype == torch.int64 and out.shape == (x.shape[0],)
    assert torch.equal(out, torch.argmax(x, dim=-1))


@pytest.mark.parametrize("n", [1, 7, 16, 17, 31, 32, 33, 1000, 49152])
def test_random_rows(n: int, isa_level: str) -> None:
    g = torch.Generator().manual_seed(n)
    check(torch.randn(9, n, generator=g))


@pytest.mark.parametrize("n", [5, 16, 40, 257])
def test_ties_take_the_first_index(n: int, isa_level: str) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 3, (64, n), generator=g).float()  # many ties for the largest value, in every lane
    check(x)
    check(torch.zeros(3, n))
    check(torch.full((2, n), -float("inf")))
    y = torch.zeros(4, n)
    y[:, ::2] = -0.0  # -0 == +0: the first of them
    check(y)


@pytest.mark.parametrize("n", [3, 16, 50])
def test_nan_and_infinities(n: int, isa_level: str) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    x[0, n - 1] = float("nan")  # the last value, in the tail
    x[1, n // 2] = float("nan")
    x[1, n - 1] = float("nan")  # two: the first wins
    x[2, 0] = float("inf")
    x[2, n - 1] = float("inf")
    x[3, :] = -float("inf")
    x[3, n // 2] = float("nan")
    x[4, n - 1] = float("inf")
    check(x)


def test_strided_rows_and_threads(isa_level: str) -> None:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(33, 600, generator=g)
    view = big[:, 50:550]  # rows 600 apart, unit inner stride
    for threads in (1, 2, 3):
        with torch_threads(threads):
            check(view)


def test_wrapper_takes_what_the_op_does_not_to_torch() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 70, generator=g)
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
    assert torch.equal(argmax_rows(x.t()), torch.argmax(x.t(), dim=-1))  # inner stride 70: torch's
    assert torch.equal(argmax_rows(x.bfloat16()), torch.argmax(x.bfloat16(), dim=-1))
    assert torch.equal(argmax_rows(x.double()), torch.argmax(x.double(), dim=-1))


def test_op_rejects_what_it_does_not_take() -> None:
    with pytest.raises(RuntimeError, match="unit inner stride"):
        torch.ops.baton_cpu.argmax_rows(torch.randn(4, 5).t())
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.baton_cpu.argmax_rows(torch.randn(4, 5).double())
    with pytest.raises(RuntimeError, match="0 < n"):
        torch.ops.baton_cpu.argmax_rows(torch.randn(4, 0))
