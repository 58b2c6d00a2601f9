"""Shared fixtures for the attention op tests.

Without CUDA the Triton kernels run on CPU tensors through the interpreter, which
tests/conftest.py switches on before anything is collected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from shared.kv.layout import KVLayout
from shared.ops.attention import AttentionMetadata, write_kv


@dataclass
class AttentionBatch:
    """One mixed batch: packed queries, a filled paged cache, and the dense truth per sequence."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim] this step's keys
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    kv: torch.Tensor  # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
    layer: int
    meta: AttentionMetadata
    dense_keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    dense_values: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    scale: float

    @property
    def k_cache(self) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
        return self.kv[self.layer, :, 0]

    @property
    def v_cache(self) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
        return self.kv[self.layer, :, 1]

    def poison_unused_slots(self) -> None:
        """Set every cache slot no sequence may read (including block tails) to NaN."""
        num_blocks, block_size = self.kv.shape[1], self.kv.shape[3]
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=self.kv.device)
        for i, s_len in enumerate(self.meta.seq_lens_host):
            pos = torch.arange(s_len, device=self.kv.device)
            used[self.meta.block_tables[i].long()[pos // block_size], pos % block_size] = True
        # [num_blocks, block_size, 2, H, D] view: a bool index over the first two dims writes through.
        if self.kv.dtype.itemsize == 1:  # fp8: torch fills no float8 tensor; 0x7f is NaN in e4m3fn and e5m2
            self.kv.view(torch.uint8)[self.layer].transpose(1, 2)[~used] = 0x7F
        else:
            self.kv[self.layer].transpose(1, 2)[~used] = float("nan")


def _allocate_tables(
    seq_lens: Sequence[int], num_blocks: int, block_size: int, gen: torch.Generator
) -> list[list[int]]:
    """Give each sequence enough blocks, drawn in shuffled order so tables are non-contiguous."""
    # Block 0 is left out so the zero padding of a table never aliases a real block.
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for s_len in seq_lens:
        n = -(-s_len // block_size)
        tables.append(free[:n])
        free = free[n:]
    return tables


def build_batch(
    seqs: Sequence[tuple[int, int]],  # (context_len, query_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> AttentionBatch:
    """A batch whose earlier context sits in the cache and whose new K/V went through `write_kv`."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in seqs]
    query_lens = [q for _, q in seqs]
    need = sum(-(-s // block_size) for s in seq_lens)
    layout = KVLayout(2, need + 5, block_size, num_kv_heads, head_dim, dtype)
    # Random fill: slots nobody writes hold garbage rather than zeros.
    kv = torch.randn(layout.shape, generator=gen).to(dtype=dtype, device=device)
    layer = 1
    tables = _allocate_tables(seq_lens, layout.num_blocks, block_size, gen)
    width = max(len(t) for t in tables) + 2
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    block_tables = block_tables.to(device)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    dense_k = [rand(s, num_kv_heads, head_dim) for s in seq_lens]
    dense_v = [rand(s, num_kv_heads, head_dim) for s in seq_lens]
    slots = []
    for i, (c, q) in enumerate(seqs):
        pos = torch.arange(c + q)
        slots.append(block_tables[i].cpu().long()[pos // block_size] * block_size + pos % block_size)
    # Earlier context goes straight into the cache; this step's keys via write_kv, as the engine does.
    ctx_slots = torch.cat([s[:c] for s, (c, _) in zip(slots, seqs, strict=True)]).to(device)
    write_kv(
        kv[layer, :, 0], kv[layer, :, 1],
        torch.cat([k[:c] for k, (c, _) in zip(dense_k, seqs, strict=True)]),
        torch.cat([v[:c] for v, (c, _) in zip(dense_v, seqs, strict=True)]),
        ctx_slots,
    )  # fmt: skip
    slot_mapping = torch.cat([s[c:] for s, (c, _) in zip(slots, seqs, strict=True)]).to(device)
    key = torch.cat([k[c:] for k, (c, _) in zip(dense_k, seqs, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(dense_v, seqs, strict=True)])
    write_kv(kv[layer, :, 0], kv[layer, :, 1], key, value, slot_mapping)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables,
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    query = rand(sum(query_lens), num_heads, head_dim)
    return AttentionBatch(query, key, value, kv, layer, meta, dense_k, dense_v, head_dim**-0.5)


@pytest.fixture(params=["portable", "avx2", "avx512", "avx512_bf16", "amx"])
def isa_level(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each instruction-set level of the CPU kernels in turn (shared/ops/cpu_isa.py), active for the test;
    a level this CPU cannot run skips, naming the instructions it lacks."""
    from shared.ops import cpu_isa

    level: str = request.param
    if not cpu_isa.isa_supported(level):
        pytest.skip(f"level {level} {cpu_isa.missing_for(level)}")
    with cpu_isa.use_isa(level):
        yield level


@pytest.fixture
def make_batch() -> Callable[..., AttentionBatch]:
    """Factory for `AttentionBatch`es; see `build_batch`."""
    return build_batch


def fp8_subnormals_zeroed(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache with its subnormal values set to zero (a bf16 one as it is): what the attention kernels'
    vdpbf16ps passes read (csrc/bf16_pairs.h)."""
    if cache.dtype.itemsize != 1:
        return cache
    values = cache.float()
    smallest_normal = 2.0**-6 if cache.dtype == torch.float8_e4m3fn else 2.0**-14
    return torch.where(values.abs() < smallest_normal, 0.0, values).to(cache.dtype)
