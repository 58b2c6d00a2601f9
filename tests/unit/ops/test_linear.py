"""LinearWeight against the reference F.linear, for every backend this machine has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.ops.linear import LinearWeight, onednn_available

BACKENDS = ["torch"] + (["onednn"] if onednn_available(torch.device("cpu")) else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, 3, 16, 130, 700])
def test_matches_f_linear(backend: str, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 576, generator=g) * 0.05
    x = torch.randn(rows, 576, generator=g)
    lin = LinearWeight(w, backend)
    assert lin.backend == backend
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_input(backend: str) -> None:
    w = torch.randn(64, 32)
    x = torch.randn(32, 10).t()  # [10, 32], not contiguous
    torch.testing.assert_close(LinearWeight(w, backend)(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_rejects_wrong_shapes() -> None:
    with pytest.raises(ValueError):
        LinearWeight(torch.randn(3, 4, 5))
    with pytest.raises(AssertionError):
        LinearWeight(torch.randn(8, 4))(torch.randn(2, 5))
