"""The CPU's C++ decode kernel against the torch reference, on batches with earlier context in the cache.

Short rows (decodes, verify chunks of up to 17 tokens) go through the decode kernel, long
prefill chunks through the prefill kernel (csrc/prefill_attention_cpu.cpp; its own tests are
test_prefill_attention.py), so mixed batches check the split too. The kernels must build on
any machine that runs the tests (they need the C++ compiler torch uses); a machine where they
do not fails here rather than silently comparing the reference with itself.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shared.kv.cache_dtype import to_cache_dtype
from shared.ops import cpu_attention, cpu_isa
from shared.ops.attention import paged_attention_ref
from tests.helpers.torch_threads import torch_threads
from tests.unit.ops.conftest import AttentionBatch, fp8_subnormals_zeroed

MIXED = [(13, 9), (0, 11), (5, 1), (30, 1), (0, 1), (17, 1), (40, 17), (3, 30)]


def run_both(batch: AttentionBatch, sliding_window: int | None, poison: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference). `poison`: NaN in every slot no sequence may read, before the kernel runs
    (the reference reads whole blocks, so it runs first, on the clean cache)."""
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    ref = paged_attention_ref(*args, sliding_window)
    batch.meta.step_cache.clear()
    if poison:
        batch.poison_unused_slots()  # a read outside a sequence's keys turns its rows to NaN
    out = cpu_attention.paged_attention_cpu(*args, sliding_window)
    return out, ref


def test_kernel_builds() -> None:
    assert cpu_attention.cpu_kernel_available(), "the C++ attention kernel did not build (see the log)"


@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (9, 3, 64, 4), (4, 1, 256, 8), (8, 8, 32, 16), (16, 2, 8, 8), (6, 2, 12, 16),
     (4, 2, 96, 16), (8, 2, 128, 16)],
    # With AVX-512, head_dim 32, 64, 128 and 256 take the wide path (gemma3: a KV head's 4 query heads one at a
    # time; d128: two at a time), the others the portable loops. d12: dot products with a scalar tail; d96:
    # a value pass narrower than the 64-lane accumulator. At avx2 every head_dim but d12 takes the 8-lane path
    # (d8: one vector, 8 query heads' sums at once; d96: its dims in slices of 8 vectors and of 4).
    ids=["smollm2", "block4", "gemma3", "mha", "group8-d8", "d12", "d96", "d128"],
)
def test_matches_reference(make_batch: Callable[..., AttentionBatch], num_heads: int, num_kv_heads: int,
                           head_dim: int, block_size: int, sliding_window: int | None, isa_level: str) -> None:
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size)
    out, ref = run_both(batch, sliding_window, poison=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("batch_shape", [[(30, 1)], [(5, 1), (17, 3)]], ids=["one-row", "four-rows"])
def test_few_rows_split_their_heads_across_jobs(make_batch: Callable[..., AttentionBatch], threads: int,
                                                batch_shape: list[tuple[int, int]], isa_level: str) -> None:
    """With fewer rows than twice the threads, a row's KV heads are split over jobs (8 heads: 1 to 8 per job)."""
    with torch_threads(threads):
        batch = make_batch(batch_shape, 8, 8, 32, 16)
        out, ref = run_both(batch, None, poison=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_positions_are_the_truth_when_host_lengths_are_upper_bounds(make_batch: Callable[..., AttentionBatch]) -> None:
    """The zero-bubble loop's host seq_lens may overshoot; the device positions say where each query is."""
    batch = make_batch([(20, 1), (9, 4), (33, 1)], 9, 3, 64, 16)
    truth = batch.meta.positions = torch.cat(
        [torch.arange(s - q, s) for s, q in zip(batch.meta.seq_lens_host, batch.meta.query_lens_host, strict=True)])
    _, ref = run_both(batch, None)
    batch.meta.seq_lens_host = [s + 3 for s in batch.meta.seq_lens_host]  # upper bounds, as planned ahead
    batch.meta.step_cache.clear()
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    out = cpu_attention.paged_attention_cpu(*args, None)
    assert torch.equal(batch.meta.positions, truth)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_other_dtypes_use_the_reference(make_batch: Callable[..., AttentionBatch]) -> None:
    batch = make_batch([(10, 1), (4, 1)], 4, 2, 32, 8, dtype=torch.bfloat16)
    out, ref = run_both(batch, None)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_op_stores_what_write_kv_stores(dtype: torch.dtype) -> None:
    """The C++ store against the two index_put_: same bytes in the same slots, nothing else touched; keys
    come as the decoder hands them, strided views into the qkv projection's output."""
    from shared.ops.attention import write_kv

    g = torch.Generator().manual_seed(3)
    layers, blocks, bs, heads, dim, n = 2, 9, 4, 3, 8, 11
    cache = torch.randn(layers, blocks, 2, bs, heads, dim, generator=g).to(dtype)
    qkv = torch.randn(n, (3 + 2 * heads) * dim, generator=g).to(dtype)
    key = qkv[:, 3 * dim:(3 + heads) * dim].view(n, heads, dim)
    value = qkv[:, (3 + heads) * dim:].view(n, heads, dim)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    expected = cache.clone()
    write_kv(expected[1, :, 0], expected[1, :, 1], key, value, slots)
    cpu_attention.write_kv_cpu(cache[1, :, 0], cache[1, :, 1], key, value, slots)
    assert torch.equal(cache, expected)


def test_write_kv_op_rejects_a_slot_outside_the_cache() -> None:
    cache = torch.zeros(3, 2, 4, 2, 8)
    key = torch.ones(1, 2, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_attention.write_kv_cpu(cache[:, 0], cache[:, 1], key, key, torch.tensor([12]))


def as_cache_dtype(batch: AttentionBatch, kv_dtype: torch.dtype) -> float | None:
    """The batch's cache in `kv_dtype`, and this step's keys and values as the engine stores them there: the
    reference on them, widened, is the truth. From avx512_bf16 up a bf16 or fp8 cache's decode rows take
    vdpbf16ps passes (paged_decode_impl.h), which read fp8 subnormals as zero and round the query and the
    softmax weights to bf16: there the cache holds no subnormal and the query is one bf16 holds exactly, and
    the tolerance those passes need is returned (at most 2^-9 of the largest value; allowed: 2^-8). None
    where the kernel reads the cache exactly and computes in fp32."""
    batch.kv = to_cache_dtype(batch.kv, kv_dtype)  # the cache rounded; this step's keys (stored by the engine) too
    batch.key = to_cache_dtype(batch.key, kv_dtype).float()
    batch.value = to_cache_dtype(batch.value, kv_dtype).float()
    if kv_dtype == torch.float32 or not cpu_isa.isa_at_least("avx512_bf16"):
        return None
    batch.kv = fp8_subnormals_zeroed(batch.kv)
    batch.key = fp8_subnormals_zeroed(batch.key.to(kv_dtype)).float()
    batch.value = fp8_subnormals_zeroed(batch.value.to(kv_dtype)).float()
    batch.query = batch.query.bfloat16().float()
    return 2**-8 * max(batch.kv[:, :, 1].float().abs().max().item(), batch.value.abs().max().item())


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 1, 256, 8), (6, 2, 12, 16), (8, 2, 128, 16)],
    ids=["smollm2", "gemma3", "d12", "d128"],
)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["bf16", "e4m3", "e5m2"])
def test_a_narrow_cache_under_fp32_queries(make_batch: Callable[..., AttentionBatch], num_heads: int,
                                           num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype,
                                           isa_level: str) -> None:
    """A bf16 or fp8 KV cache is widened as it is read: the reference on the same cache, widened, is the truth.
    The fp8 caches hold keys of magnitudes from 1e-4 to 4 and values up to 1000, so that every code,
    subnormals too, is read (the tolerance grows with the outputs). From avx512_bf16 up the outputs may differ
    by the vdpbf16ps passes' rounding (as_cache_dtype); the prefill kernel's rows stay as exact as before."""
    for window in (None, 7):
        batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size)
        if kv_dtype != torch.bfloat16:
            g = torch.Generator().manual_seed(head_dim)
            exponents = torch.empty(batch.kv.shape).uniform_(-4, 2.5, generator=g)
            exponents[:, :, 0] = exponents[:, :, 0].clamp(max=0)  # keys up to ~4: no score in the thousands
            batch.kv = batch.kv * torch.pow(10.0, exponents)
        atol = as_cache_dtype(batch, kv_dtype)
        out, ref = run_both(batch, window, poison=True)
        atol = atol or 1e-5 * max(1.0, ref.abs().max().item())
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-5)


KV_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
KV_IDS = ["fp32", "bf16", "e4m3", "e5m2"]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 1, 256), (3, 3, 40), (8, 2, 24), (4, 2, 512)],
    # d40 and d24: dims in slices of 4 vectors and 1, of 2 and 1 at avx2; d512: the widest it takes (Gemma 4's
    # global layers), the portable loops from avx512 up
    ids=["smollm2", "gemma3", "mha-d40", "group4-d24", "d512"],
)
def test_contexts_around_the_chunk_edges(make_batch: Callable[..., AttentionBatch], num_heads: int,
                                         num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                                         isa_level: str) -> None:
    """A decode row at each position 0 .. 33: contexts of 1 to 34 keys, so chunks of 8 (avx2) and 16 (avx512)
    keys end full and short by every count, whole and under sliding windows of 7, 8 and 9 keys."""
    for window in (None, 7, 8, 9):
        batch = make_batch([(context, 1) for context in range(34)], num_heads, num_kv_heads, head_dim, 8)
        atol = as_cache_dtype(batch, kv_dtype)
        out, ref = run_both(batch, window, poison=True)
        atol = atol or 1e-5 * max(1.0, ref.abs().max().item())
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(make_batch: Callable[..., AttentionBatch],
                                                               kv_dtype: torch.dtype, isa_level: str) -> None:
    """Each decode row's output, bit for bit, from the whole batch on one thread (a job per row) and from a
    batch of that row alone on four (its KV heads split over jobs): the sums run in a fixed order."""
    batch = make_batch([(context, 1) for context in (0, 7, 8, 15, 30, 61)], 9, 3, 64, 16)
    as_cache_dtype(batch, kv_dtype)
    kernel_rows = cpu_attention.kernel_rows(batch.meta, batch.query.device)
    assert kernel_rows is not None  # decode rows only: the kernel takes them all
    rows, row_seq, row_pos = kernel_rows

    def decode(keep: slice, threads: int) -> torch.Tensor:
        out = torch.zeros_like(batch.query)
        with torch_threads(threads):
            torch.ops.baton_cpu.paged_decode(out, batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                                             rows[keep], row_seq[keep], row_pos[keep], batch.scale, 0)
        return out

    whole = decode(slice(None), 1)
    for i in range(rows.numel()):
        alone = decode(slice(i, i + 1), 4)
        assert torch.equal(alone[rows[i]], whole[rows[i]]), f"row {i}"


def _fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an fp8 format, the midpoints between neighbours (ties, which round to the even
    code), values just either side of them, past the largest value and at zero, both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    exact = codes[codes.isfinite()].unique()  # sorted
    mids = (exact[1:] + exact[:-1]) / 2
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    big = torch.tensor([1e6, float("inf"), exact.max().item() * 1.04, exact.max().item() * 1.2])
    values = torch.cat([exact, mids, near, big, torch.tensor([0.0, 1e-30])])
    return torch.cat([values, -values])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_write_kv_op_rounds_fp32_keys_into_an_fp8_cache(kv_dtype: torch.dtype) -> None:
    """Every fp8 value, every tie between two and values past the largest: the same bits as write_kv's, which
    clamps and lets torch round (shared/kv/cache_dtype.py), and no inf ever stored."""
    from shared.ops.attention import write_kv

    grid = _fp8_grid(kv_dtype)
    heads, dim = 2, 8
    n = -(-grid.numel() // (heads * dim))
    values = torch.zeros(n * heads * dim)
    values[: grid.numel()] = grid
    key = values.view(n, heads, dim)
    value = key.flip(0).contiguous()
    blocks, bs = -(-n // 4) + 1, 4
    caches = [torch.zeros(blocks, bs, heads, dim, dtype=kv_dtype) for _ in range(4)]
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(0))[:n]
    write_kv(caches[0], caches[1], key, value, slots)
    torch.ops.baton_cpu.write_kv_(caches[2], caches[3], key, value, slots)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[2].float().isfinite().all()
    # the fp8 values themselves (the grid's first ones) come back as they were
    stored = caches[2].float()[slots // bs, slots % bs].reshape(-1)
    codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    count = codes[codes.isfinite()].unique().numel()
    assert torch.equal(stored[:count], grid[:count])


def test_write_kv_op_rounds_fp32_keys_into_a_bf16_cache() -> None:
    """The same bytes as write_kv's index_put_ of the keys converted by torch (round to nearest even)."""
    from shared.ops.attention import write_kv

    g = torch.Generator().manual_seed(1)
    caches = [torch.zeros(6, 4, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    key, value = torch.randn(5, 2, 8, generator=g) * 100, torch.randn(5, 2, 8, generator=g)
    key[0, 0, 0] = float("nan")
    slots = torch.tensor([3, 9, 0, 22, 17])
    write_kv(caches[0], caches[1], key, value, slots)
    torch.ops.baton_cpu.write_kv_(caches[2], caches[3], key, value, slots)
    # torch's own NaN bits differ between its scalar and vector conversions: a NaN only has to stay one
    assert caches[2][0, 3, 0, 0].isnan() and caches[0][0, 3, 0, 0].isnan()
    caches[0][0, 3, 0, 0] = caches[2][0, 3, 0, 0] = 0
    assert torch.equal(caches[0].view(torch.int16), caches[2].view(torch.int16))
    assert torch.equal(caches[1].view(torch.int16), caches[3].view(torch.int16))
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.baton_cpu.write_kv_(caches[2].float(), caches[3].float(), key.bfloat16(), value.bfloat16(), slots)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_bits_do_not_depend_on_the_prefetch(make_batch: Callable[..., AttentionBatch], kv_dtype: torch.dtype,
                                            isa_level: str) -> None:
    """The wide path's software prefetch (paged_decode_prefetch turns it off) moves no value."""
    batch = make_batch(MIXED, 9, 3, 64, 16)
    batch.kv = batch.kv.to(kv_dtype)
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    on = cpu_attention.paged_attention_cpu(*args, None)
    previous = torch.ops.baton_cpu.paged_decode_prefetch(False)
    try:
        assert previous
        batch.meta.step_cache.clear()
        assert torch.equal(cpu_attention.paged_attention_cpu(*args, None), on)
    finally:
        torch.ops.baton_cpu.paged_decode_prefetch(previous)
