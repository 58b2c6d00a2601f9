"""The Triton fused-MoE kernels against the torch loop (`TorchExperts`) on the same weights and routing.

Without CUDA, conftest switches Triton to its interpreter and the kernels run on
CPU tensors; shapes stay small because the interpreter is slow. The
`gpu`-marked test compiles the kernels and checks gemma-4-26B-A4B's expert
shapes in fp32 and bf16.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from shared.models.gemma4.moe import TorchExperts

fused = importlib.import_module("shared.ops.fused_moe_triton")
# triton is installed everywhere (a dependency): without CUDA, conftest turns its interpreter on
assert fused.triton_available(), "triton does not run here (neither CUDA nor its interpreter)"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(n: int, num_experts: int, hidden: int, inter: int, top_k: int, seed: int,
              dtype: torch.dtype = torch.float32, device: str = DEVICE) -> tuple[torch.Tensor, ...]:
    """(h, weights, index, gate_up, down); the routing leaves some experts idle and gives others many rows."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    h = torch.randn(n, hidden, generator=gen)
    # skewed: experts drawn from the first half more often, so runs of one expert span several blocks
    scores = torch.rand(n, num_experts, generator=gen) + (torch.arange(num_experts) < num_experts // 2) * 0.5
    index = torch.topk(scores, top_k, dim=-1).indices
    weights = torch.rand(n, top_k, generator=gen)
    return tuple(t.to(device) for t in (h, weights, index, gate_up, down))


@pytest.mark.parametrize(("n", "num_experts", "hidden", "inter", "top_k"),
                         [(1, 8, 64, 32, 2), (7, 6, 48, 40, 3), (40, 8, 96, 24, 2)])
def test_matches_the_torch_loop_fp32(n: int, num_experts: int, hidden: int, inter: int, top_k: int) -> None:
    h, weights, index, gate_up, down = make_case(n, num_experts, hidden, inter, top_k, seed=n)
    expected = TorchExperts(gate_up, down)(h, weights, index)
    out = fused.fused_moe_triton(h, weights, index, gate_up, down)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_bf16_weights_match_the_torch_loop_on_the_same_weights() -> None:
    h, weights, index, gate_up, down = make_case(9, 8, 64, 32, 2, seed=3, dtype=torch.bfloat16)
    expected = TorchExperts(gate_up.float(), down.float())(h, weights, index)
    out = fused.fused_moe_triton(h, weights, index, gate_up, down)
    assert out.dtype == h.dtype
    # the rows go into the dots as bf16 (tensor-core inputs): bf16-sized error
    torch.testing.assert_close(out, expected, atol=5e-2, rtol=3e-2)


def test_alignment_puts_every_pair_once_in_blocks_of_one_expert() -> None:
    index = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])
    al = fused.align_by_expert(index, num_experts=5, block_m=4)
    pairs = al.sorted_pairs.tolist()
    num_rows = int(al.num_rows.item())
    # expert 0: 2 pairs, 1: 2, 2: 1, 3: 5 -> padded 4 + 4 + 4 + 8 rows
    assert num_rows == 20 and len(pairs) >= num_rows
    real = [p for p in pairs[:num_rows] if p < index.numel()]
    assert sorted(real) == list(range(index.numel())) and all(p == index.numel() for p in pairs[num_rows:])
    flat = index.reshape(-1).tolist()
    for b in range(num_rows // 4):
        experts = {flat[p] for p in pairs[4 * b:4 * b + 4] if p < index.numel()}
        assert experts == {al.block_expert[b].item()}
    assert [p for p in pairs[12:20] if p < 10] == [0, 2, 5, 6, 9]  # expert 3's pairs, in token order


def test_no_tokens_give_an_empty_result() -> None:
    _, _, _, gate_up, down = make_case(1, 4, 32, 16, 2, seed=0)
    h = torch.zeros(0, 32, device=DEVICE)
    out = fused.fused_moe_triton(h, torch.zeros(0, 2, device=DEVICE), torch.zeros(0, 2, dtype=torch.long,
                                 device=DEVICE), gate_up, down)
    assert out.shape == (0, 32)


def test_mismatched_shapes_are_refused() -> None:
    h, weights, index, gate_up, down = make_case(2, 4, 32, 16, 2, seed=0)
    with pytest.raises(AssertionError, match="hidden"):
        fused.fused_moe_triton(h[:, :16].contiguous(), weights, index, gate_up, down)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 16, 300])
def test_matches_the_torch_loop_on_gpu_at_published_sizes(dtype: torch.dtype, n: int) -> None:
    """gemma-4-26B-A4B's experts (128 of hidden 2816, width 704, top 8), compiled."""
    h, weights, index, gate_up, down = make_case(n, 128, 2816, 704, 8, seed=n, dtype=dtype)
    h = h * 0.05
    expected = TorchExperts(gate_up.float(), down.float())(h, weights, index)
    out = fused.fused_moe_triton(h, weights, index, gate_up, down)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out, expected, atol=tol * expected.abs().max().item(), rtol=tol)
