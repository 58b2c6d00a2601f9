"""Gemma 4's router and grouped experts against transformers' modules on the same weights."""

from __future__ import annotations

import torch

from shared.models.gemma4.moe import Experts, Router
from tests.helpers.gemma4 import randomize_gemma4, tiny_gemma4_config


def _hf_moe(num_experts: int, top_k: int):  # type: ignore[no-untyped-def]
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    config = tiny_gemma4_config("moe", num_experts=num_experts, top_k_experts=top_k)
    router, experts = Gemma4TextRouter(config), Gemma4TextExperts(config)
    for i, module in enumerate((router, experts)):
        randomize_gemma4(module, seed=i)
    return config, router, experts


def test_router_and_grouped_experts_match_transformers() -> None:
    config, hf_router, hf_experts = _hf_moe(num_experts=8, top_k=3)
    router = Router(hf_router.scale.data, hf_router.proj.weight.data, hf_router.per_expert_scale.data, 3,
                    config.rms_norm_eps)
    experts = Experts(hf_experts.gate_up_proj.data, hf_experts.down_proj.data)
    x = torch.randn(50, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_weights, hf_index = hf_router(x)
        expected = hf_experts(x, hf_index, hf_weights)
    weights, index = router(x)
    assert torch.equal(index, hf_index)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    torch.testing.assert_close(experts.grouped(x, weights, index), expected, atol=1e-5, rtol=1e-5)


def test_grouped_experts_with_idle_experts_and_one_token() -> None:
    config, _, hf_experts = _hf_moe(num_experts=16, top_k=2)
    experts = Experts(hf_experts.gate_up_proj.data, hf_experts.down_proj.data)
    x = torch.randn(1, config.hidden_size)
    index = torch.tensor([[15, 3]])
    weights = torch.tensor([[0.25, 0.75]])
    with torch.no_grad():
        expected = hf_experts(x, index, weights)
    torch.testing.assert_close(experts.grouped(x, weights, index), expected, atol=1e-5, rtol=1e-5)
