"""Rounding into a KV cache's dtype, and what a handoff's hidden states travel in (shared/kv/cache_dtype.py)."""

from __future__ import annotations

import pytest
import torch

from shared.kv.cache_dtype import hidden_dtype, to_cache_dtype
from shared.kv.layout import KVLayout


@pytest.mark.parametrize(("dtype", "largest"), [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_fp8_saturates_where_torch_would_not(dtype: torch.dtype, largest: float) -> None:
    """Past the largest finite value (and at inf) the cache holds that value, never an inf or a NaN."""
    x = torch.tensor([1e6, -1e6, float("inf"), -float("inf"), largest * 1.1, 0.5])
    stored = to_cache_dtype(x, dtype).float()
    assert stored.tolist() == [largest, -largest, largest, -largest, largest, 0.5]
    assert torch.equal(to_cache_dtype(x[-1:], dtype), x[-1:].to(dtype))  # in range: torch's own rounding


def test_a_tensor_already_in_the_dtype_is_kept() -> None:
    x = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert to_cache_dtype(x, torch.float8_e4m3fn) is x
    assert to_cache_dtype(torch.tensor([1.5]), torch.bfloat16).dtype == torch.bfloat16


def test_hidden_states_travel_in_bf16_beside_an_fp8_cache() -> None:
    assert [hidden_dtype(d) for d in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)] == [
        torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    layout = KVLayout(2, 4, 16, 3, 64, torch.float8_e4m3fn)
    assert layout.itemsize == 1 and layout.hidden_dtype == torch.bfloat16
    # a budget holds twice the blocks in fp8 that it holds in bf16 (a bf16 block: 2 * 2 * 16 * 3 * 64 bytes a layer)
    budget = 10 * 2 * (2 * 2 * 16 * 3 * 64)
    assert KVLayout.blocks_for_bytes(budget, 2, 16, 3, 64, torch.bfloat16) == 10
    assert KVLayout.blocks_for_bytes(budget, 2, 16, 3, 64, torch.float8_e4m3fn) == 20
