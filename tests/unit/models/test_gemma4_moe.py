"""Gemma 4's router and grouped experts against transformers' modules on the same weights."""

from __future__ import annotations

import pytest
import torch

from shared.models.gemma4.moe import Router, TorchExperts, make_experts
from shared.models.gemma4.moe_cpu import PackedExperts
from shared.models.gemma4.tiny import randomize
from shared.ops.cpu_kernels import cpu_kernels_available
from tests.helpers.gemma4 import tiny_gemma4_config


def _hf_moe(num_experts: int, top_k: int):  # type: ignore[no-untyped-def]
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    config = tiny_gemma4_config("moe", num_experts=num_experts, top_k_experts=top_k)
    router, experts = Gemma4TextRouter(config), Gemma4TextExperts(config)
    for i, module in enumerate((router, experts)):
        randomize(module, seed=i)
    return config, router, experts


def test_router_and_grouped_experts_match_transformers() -> None:
    config, hf_router, hf_experts = _hf_moe(num_experts=8, top_k=3)
    router = Router(hf_router.scale.data, hf_router.proj.weight.data, hf_router.per_expert_scale.data, 3,
                    config.rms_norm_eps)
    experts = TorchExperts(hf_experts.gate_up_proj.data, hf_experts.down_proj.data)
    x = torch.randn(50, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_weights, hf_index = hf_router(x)
        expected = hf_experts(x, hf_index, hf_weights)
    weights, index = router(x)
    assert torch.equal(index, hf_index)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    torch.testing.assert_close(experts(x, weights, index), expected, atol=1e-5, rtol=1e-5)


def test_grouped_experts_with_idle_experts_and_one_token() -> None:
    config, _, hf_experts = _hf_moe(num_experts=16, top_k=2)
    experts = TorchExperts(hf_experts.gate_up_proj.data, hf_experts.down_proj.data)
    x = torch.randn(1, config.hidden_size)
    index = torch.tensor([[15, 3]])
    weights = torch.tensor([[0.25, 0.75]])
    with torch.no_grad():
        expected = hf_experts(x, index, weights)
    torch.testing.assert_close(experts(x, weights, index), expected, atol=1e-5, rtol=1e-5)


def _routing(n: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(n)])
    return torch.rand(n, top_k, generator=gen), index


@pytest.mark.parametrize("n", [1, 5, 40])
def test_packed_experts_match_the_torch_loop_fp32(n: int) -> None:
    if not cpu_kernels_available():
        pytest.fail("the C++ CPU kernels did not build (see the log)")
    gen = torch.Generator().manual_seed(1)
    num_experts, hidden, inter, top_k = 12, 72, 40, 3  # widths off the kernels' 32-lane panels
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    x = torch.randn(n, hidden, generator=gen)
    weights, index = _routing(n, num_experts, top_k, seed=n)
    expected = TorchExperts(gate_up, down)(x, weights, index)
    experts = PackedExperts(gate_up, down)
    torch.testing.assert_close(experts(x, weights, index), expected, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # as the model runs it: the op's worker threads must not update in place
        torch.testing.assert_close(experts(x, weights, index), expected, atol=1e-5, rtol=1e-5)


def test_packed_experts_bf16_match_the_torch_loop_on_bf16_weights() -> None:
    if not cpu_kernels_available():
        pytest.fail("the C++ CPU kernels did not build (see the log)")
    gen = torch.Generator().manual_seed(2)
    num_experts, hidden, inter, top_k, n = 8, 64, 48, 2, 9
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).bfloat16()
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).bfloat16()
    x = torch.randn(n, hidden, generator=gen)
    weights, index = _routing(n, num_experts, top_k, seed=3)
    expected = TorchExperts(gate_up.float(), down.float())(x, weights, index)
    # rows are rounded to bf16 on the way into vdpbf16ps (AVX512-BF16 CPUs): bf16-sized error, not fp32's
    torch.testing.assert_close(PackedExperts(gate_up, down)(x, weights, index), expected, atol=3e-2, rtol=2e-2)


def test_packed_experts_refuse_an_expert_index_out_of_range() -> None:
    if not cpu_kernels_available():
        pytest.fail("the C++ CPU kernels did not build (see the log)")
    experts = PackedExperts(torch.randn(4, 16, 32), torch.randn(4, 32, 8))
    with pytest.raises(RuntimeError, match="expert index 4"):
        experts(torch.randn(1, 32), torch.ones(1, 2), torch.tensor([[0, 4]]))


def test_make_experts_picks_the_packed_kernel_on_the_cpu() -> None:
    experts = make_experts(torch.randn(4, 16, 32), torch.randn(4, 32, 8))
    assert isinstance(experts, PackedExperts if cpu_kernels_available() else TorchExperts)


def test_torch_loop_takes_fp32_rows_over_bf16_weights() -> None:
    """Where no kernel serves bf16 experts (kernels not built) the loop runs them in their dtype and returns
    rows in the input's."""
    gen = torch.Generator().manual_seed(5)
    gate_up, down = torch.randn(4, 16, 32, generator=gen).bfloat16(), torch.randn(4, 32, 8, generator=gen).bfloat16()
    x = torch.randn(3, 32, generator=gen)
    weights, index = _routing(3, 4, 2, seed=6)
    out = TorchExperts(gate_up, down)(x, weights, index)
    assert out.dtype == torch.float32
    expected = TorchExperts(gate_up.float(), down.float())(x.bfloat16().float(), weights, index)
    torch.testing.assert_close(out, expected, atol=0.1, rtol=0.05)


def _int8_reference(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                    index: torch.Tensor) -> torch.Tensor:
    """Each token's experts through the W8A8 kernel's own reference sums (shared/ops/w8a8.py), weighted and summed
    in expert order."""
    from shared.ops.quant import int8_per_channel
    from shared.ops.w8a8 import w8a8_ref

    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(index.shape[1]), key=lambda j: int(index[t, j])):
            e = int(index[t, j])
            gu = w8a8_ref(x[t:t + 1], int8_per_channel(gate_up[e]))
            act = torch.nn.functional.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
            out[t] += weights[t, j] * w8a8_ref(act, int8_per_channel(down[e]))[0]
    return out


@pytest.mark.parametrize("n", [1, 7])
def test_packed_experts_int8_match_the_w8a8_reference(n: int) -> None:
    """--quantization int8: each expert int8 per output channel, rows quantized per block of 32 as the W8A8
    projections do; the op sums what the reference sums (fp32 rounding of the block fold aside)."""
    if not cpu_kernels_available():
        pytest.fail("the C++ CPU kernels did not build (see the log)")
    gen = torch.Generator().manual_seed(7)
    num_experts, hidden, inter, top_k = 6, 64, 96, 2  # 96 outputs: three 32-lane panels, the last one full
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    x = torch.randn(n, hidden, generator=gen)
    weights, index = _routing(n, num_experts, top_k, seed=8)
    experts = PackedExperts(gate_up, down, int8=True)
    assert experts.gate_up.dtype == torch.int8
    # a byte a weight plus each block's offset and the channels' scales: under a third of fp32's bytes
    assert experts.expert_nbytes < 0.3 * 4 * (gate_up[0].numel() + down[0].numel())
    got = experts(x, weights, index)
    torch.testing.assert_close(got, _int8_reference(gate_up, down, x, weights, index), atol=1e-4, rtol=1e-4)
    # and int8's error against the fp32 experts is quantization-sized
    fp32 = TorchExperts(gate_up, down)(x, weights, index)
    assert (got - fp32).abs().max() < 0.05 * fp32.abs().max()


def test_int8_experts_need_whole_blocks_and_make_experts_keeps_the_dtype_otherwise() -> None:
    if not cpu_kernels_available():
        pytest.fail("the C++ CPU kernels did not build (see the log)")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        PackedExperts(torch.randn(4, 16, 40), torch.randn(4, 40, 8), int8=True)
    odd = make_experts(torch.randn(4, 16, 40), torch.randn(4, 40, 8), int8=True)  # 40 inputs: not int8's
    assert isinstance(odd, PackedExperts) and odd.gate_up.dtype == torch.float32
    fit = make_experts(torch.randn(4, 64, 32), torch.randn(4, 32, 32), int8=True)
    assert isinstance(fit, PackedExperts) and fit.gate_up.dtype == torch.int8
