"""The Triton paged-attention kernel against `paged_attention_ref`.

Without CUDA, conftest switches Triton to its interpreter and the kernel runs on
CPU tensors; shapes here stay small because the interpreter is slow. The
`gpu`-marked test compiles the kernel and checks larger shapes and 16-bit dtypes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import pytest
import torch

from shared.ops.attention import paged_attention_ref

if TYPE_CHECKING:
    from tests.unit.ops.conftest import AttentionBatch

triton_attention = importlib.import_module("shared.ops.triton_attention")
# triton is installed everywhere (a dependency): without CUDA, conftest turns its interpreter on
assert triton_attention.triton_available(), "triton does not run here (neither CUDA nor its interpreter)"

T = TypeVar("T")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# chunk with earlier context, fresh prefill, decodes (one of them the very first token)
MIXED = [(13, 9), (0, 11), (5, 1), (30, 1), (0, 1), (17, 1)]


def run_both(
    batch: AttentionBatch, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:  # (triton, reference), each [num_tokens, num_heads, head_dim]
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    ref = paged_attention_ref(*args, sliding_window)
    out = triton_attention.paged_attention_triton(*args, sliding_window)
    return out, ref


@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "seqs"),
    [
        (9, 3, 64, 16, MIXED),  # SmolLM2-like
        (9, 3, 64, 8, MIXED),
        (8, 2, 32, 8, MIXED),
        (8, 2, 32, 4, MIXED),  # the tiny engine tests' block size
        (4, 1, 256, 8, [(6, 5), (0, 4), (19, 1)]),  # Gemma-3-like, few tokens
        (4, 1, 256, 16, [(21, 1), (9, 1)]),  # decode only: the small-tile path
    ],
    ids=["g3-d64-b16", "g3-d64-b8", "g4-d32-b8", "g4-d32-b4", "g4-d256-b8", "g4-d256-b16-decode"],
)
def test_matches_reference_fp32(
    make_batch: Callable[..., AttentionBatch],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seqs: list[tuple[int, int]],
    sliding_window: int | None,
) -> None:
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, device=DEVICE)
    out, ref = run_both(batch, sliding_window)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(8))
def test_random_configs(make_batch: Callable[..., AttentionBatch], seed: int) -> None:
    """Random group sizes (incl. 1 and 16), head dims (incl. 8, padded to 16), block sizes and windows."""
    gen = torch.Generator().manual_seed(1000 + seed)

    def pick(options: list[T]) -> T:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    num_kv_heads, group = pick([1, 2]), pick([1, 3, 4, 5, 16])
    seqs = [(randint(0, 30), pick([1, 1, randint(2, 10)])) for _ in range(randint(1, 5))]
    batch = make_batch(
        seqs,
        num_kv_heads * group,
        num_kv_heads,
        pick([8, 16, 64, 128]),
        pick([8, 16, 32]),
        device=DEVICE,
        seed=seed,
    )
    out, ref = run_both(batch, pick([None, randint(1, 20)]))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_window_of_one_and_window_past_context(make_batch: Callable[..., AttentionBatch]) -> None:
    batch = make_batch([(9, 6), (3, 1)], 6, 2, 64, 8, device=DEVICE)
    for window in (1, 2, 64):
        out, ref = run_both(batch, window)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_rows_with_no_visible_key_in_first_tile(make_batch: Callable[..., AttentionBatch]) -> None:
    """A prefill block whose later rows' windows start a whole tile after the block's first visited tile.

    With one query head per KV head a query block holds 64 tokens and a key tile
    64 positions, so tokens at positions >= 67 see nothing in tile 0: the online
    softmax must carry a row with max = -inf without producing NaN.
    """
    batch = make_batch([(60, 24), (2, 1)], 2, 2, 64, 16, device=DEVICE)
    out, ref = run_both(batch, 4)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_ignores_unreadable_slots(make_batch: Callable[..., AttentionBatch]) -> None:
    """NaN in every slot past a sequence's length (block tails, free blocks) must not leak in."""
    batch = make_batch(MIXED, 9, 3, 64, 16, device=DEVICE)
    _, ref = run_both(batch, None)
    batch.poison_unused_slots()
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    out = triton_attention.paged_attention_triton(*args)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_strided_query_and_fp16(make_batch: Callable[..., AttentionBatch]) -> None:
    """A query sliced out of a fused qkv buffer, in half precision."""
    batch = make_batch([(4, 5), (12, 1)], 4, 2, 32, 8, dtype=torch.float16, device=DEVICE)
    fused = torch.cat([batch.query, batch.query], dim=1)  # [num_tokens, 2 * num_heads, head_dim]
    batch.query = fused[:, : batch.query.shape[1]]
    assert not batch.query.is_contiguous()
    out, ref = run_both(batch, None)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)


def test_rejects_bad_inputs(make_batch: Callable[..., AttentionBatch]) -> None:
    batch = make_batch([(3, 2)], 4, 2, 32, 8, device=DEVICE)
    args = (batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    with pytest.raises(AssertionError, match="contiguous"):
        triton_attention.paged_attention_triton(
            batch.query.transpose(1, 2).contiguous().transpose(1, 2), *args
        )
    batch.meta.seq_lens = batch.meta.seq_lens.long()
    with pytest.raises(AssertionError, match="int32"):
        triton_attention.paged_attention_triton(batch.query, *args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window"),
    [(9, 3, 64, 16, None), (4, 1, 256, 16, 512), (32, 8, 128, 32, None), (16, 2, 64, 8, 100),
     (4, 2, 64, 4, None)],
)
def test_matches_reference_on_gpu(
    make_batch: Callable[..., AttentionBatch],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> None:
    """Compiled kernel, long contexts; 16-bit outputs are checked against fp32 math on the same inputs."""
    seqs = [(700, 300), (0, 1025), (333, 77), *[(n, 1) for n in (1, 15, 16, 17, 511, 512, 513, 2047, 3000)]]
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype, device="cuda")
    out = triton_attention.paged_attention_triton(
        batch.query,
        batch.key,
        batch.value,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        batch.scale,
        sliding_window,
    )
    ref = paged_attention_ref(
        batch.query.float(), batch.key.float(), batch.value.float(), batch.k_cache.float(),
        batch.v_cache.float(), batch.meta, batch.scale, sliding_window,
    )  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
