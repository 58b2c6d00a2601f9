"""The KV cache layout: one description, used by attention, transports and the store.

All layers live in one contiguous tensor so that a transport registers a
single memory region::

    kv[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
        │           │           │  └ token slot inside the block
        │           │           └ 0 = K, 1 = V
        │           └ block id (the pool hands these out)
        └ layer (layer-major, so a finished layer's blocks can be shipped
          while later layers still compute)

One (layer, block) pair is one contiguous byte range of
`block_nbytes = 2 * block_size * num_kv_heads * head_dim * itemsize` bytes
holding that block's K then V. A token's slot is `block_id * block_size +
offset`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shared.transport.memory import host_buffer


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for `a` tokens at `b` tokens per block."""
    return -(-a // b)


@dataclass(frozen=True)
class ByteRange:
    """A contiguous span inside the KV region: offset from the region's base."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def total_nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    def block_range(self, layer: int, block_id: int) -> ByteRange:
        if not (0 <= layer < self.num_layers and 0 <= block_id < self.num_blocks):
            raise IndexError(f"(layer={layer}, block={block_id}) outside {self.shape}")
        return ByteRange(layer * self.layer_nbytes + block_id * self.block_nbytes, self.block_nbytes)

    def block_ranges(self, block_ids: Sequence[int], layers: Iterable[int] | None = None) -> list[ByteRange]:
        """Byte ranges of `block_ids` in each of `layers` (all by default), layer-major."""
        layer_ids = range(self.num_layers) if layers is None else layers
        return [self.block_range(layer, b) for layer in layer_ids for b in block_ids]

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The zeroed cache; host memory is backed by huge pages, which transports copy at full speed."""
        if torch.device(device).type == "cpu":
            return host_buffer(self.shape, self.dtype)
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    @staticmethod
    def blocks_for_bytes(
        nbytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """How many blocks fit a KV budget of `nbytes` across all layers."""
        per_block = 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return nbytes // (per_block * num_layers)
