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


def _quantized_reference(quantization: str, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                         weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each token's experts through its kernel's own reference sums (int8: shared/ops/w8a8.py's; q4_1:
    shared/ops/quant.py's qgemv_ref), weighted and summed in expert order."""
    from shared.ops.quant import int8_per_channel, q4_1_blocks, qgemv_ref
    from shared.ops.w8a8 import w8a8_ref

    def project(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w8a8_ref(rows, int8_per_channel(w)) if quantization == "int8" else qgemv_ref(rows, q4_1_blocks(w))

    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(index.shape[1]), key=lambda j: int(index[t, j])):
            e = int(index[t, j])
            gu = project(x[t:t + 1], gate_up[e])
            act = torch.nn.functional.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
            out[t] += weights[t, j] * project(act, down[e])[0]
    return out


# format -> (its pack's dtype, the most its bytes may be of fp32's, its error bound against fp32's experts)
_FORMATS = {"int8": (torch.int8, 0.3, 0.05), "q4_1": (torch.uint8, 0.17, 0.15)}


@pytest.mark.parametrize("quantization", sorted(_FORMATS))
@pytest.mark.parametrize("n", [1, 7])
def test_packed_quantized_experts_match_their_kernels_reference(n: int, quantization: str) -> None:
    """--quantization int8 / q4_1: each expert int8 per output channel or in 4-bit blocks of 32, rows quantized
    per block of 32 as the quantized projections do; the op sums what the reference sums (fp32 rounding of
    the block fold aside)."""
    if not cpu_kernels_available():
        pytest.fail("the C++ CPU kernels did not build (see the log)")
    pack_dtype, byte_share, error = _FORMATS[quantization]
    gen = torch.Generator().manual_seed(7)
    num_experts, hidden, inter, top_k = 6, 64, 96, 2  # 96 outputs: three 32-lane panels, the last one full
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    x = torch.randn(n, hidden, generator=gen)
    weights, index = _routing(n, num_experts, top_k, seed=8)
    experts = PackedExperts(gate_up, down, quantization)
    assert experts.gate_up.dtype == pack_dtype
    # int8: a byte a weight plus each block's offset and the channels' scales; q4_1: half a byte plus a fp16
    # scale and minimum per 32
    assert experts.expert_nbytes < byte_share * 4 * (gate_up[0].numel() + down[0].numel())
    got = experts(x, weights, index)
    want = _quantized_reference(quantization, gate_up, down, x, weights, index)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # and the error against the fp32 experts is quantization-sized
    fp32 = TorchExperts(gate_up, down)(x, weights, index)
    assert (got - fp32).abs().max() < error * fp32.abs().max()


@pytest.mark.parametrize("quantization", sorted(_FORMATS))
def test_quantized_experts_need_whole_blocks_and_make_experts_keeps_the_dtype_otherwise(quantization: str) -> None:
    if not cpu_kernels_available():
        pytest.fail("the C++ CPU kernels did not build (see the log)")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        PackedExperts(torch.randn(4, 16, 40), torch.randn(4, 40, 8), quantization)
    with pytest.raises(ValueError, match="experts quantize to one of"):
        PackedExperts(torch.randn(4, 64, 32), torch.randn(4, 32, 32), "q3_k")
    odd = make_experts(torch.randn(4, 16, 40), torch.randn(4, 40, 8), quantization)  # 40 inputs: no whole block
    assert isinstance(odd, PackedExperts) and odd.gate_up.dtype == torch.float32
    fit = make_experts(torch.randn(4, 64, 32), torch.randn(4, 32, 32), quantization)
    assert isinstance(fit, PackedExperts) and fit.gate_up.dtype == _FORMATS[quantization][0]
