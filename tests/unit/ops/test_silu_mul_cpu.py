"""The CPU's fused silu(gate) * up gives exactly torch's `F.silu(gate) * up`.

Exact, not close: it computes silu as torch's CPU kernel does, so switching it on
changes no token. Widths that are not a multiple of the vector chunk exercise the
scalar tail; rows of a strided view are what the MLP hands it.
"""

from __future__ import annotations

import pytest
import torch

from shared.ops import silu_mul_cpu as mod
from shared.ops.silu_mul_cpu import silu_mul_cpu, silu_mul_cpu_available, silu_mul_ref

pytestmark = pytest.mark.skipif(not silu_mul_cpu_available(torch.device("cpu"), torch.float32),
                                reason="the CPU kernels did not build, are turned off, or differ from torch here")


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (16, 1536), (64, 1536), (300, 1536), (3, 1541), (2, 7)])
def test_equals_torch(rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows * width)
    gate_up = torch.randn(rows, 2 * width, generator=g) * 6.0
    assert torch.equal(silu_mul_cpu(gate_up), silu_mul_ref(gate_up))


def test_extreme_values() -> None:
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 1e30, -1e30, 20.0, -20.0] * 3)
    gate_up = torch.cat([gate, torch.linspace(-3, 3, gate.numel())]).unsqueeze(0)
    assert torch.equal(silu_mul_cpu(gate_up), silu_mul_ref(gate_up))


def test_rows_of_a_wider_tensor() -> None:
    """The op reads rows by their stride: a column slice (a view) is fine."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(9, 2 * 100 + 30, generator=g)
    view = wide[:, :200]
    assert not view.is_contiguous()
    assert torch.equal(silu_mul_cpu(view), silu_mul_ref(view.contiguous()))


def test_turned_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CPU_FUSED_SILU_MUL", "0")
    assert not mod.silu_mul_cpu_available(torch.device("cpu"), torch.float32)
