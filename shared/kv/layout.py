"""The KV cache layout: one description, used by attention, transports and the store.

All layers live in one contiguous region so that a transport registers a
single memory region. Layer-major, so a finished layer's blocks can be shipped
while later layers still compute::

    region = [layer 0 | layer 1 | ... ]          stored layers only, in order
    layer l = [num_blocks, T_l, block_size, H_l, D_l]
               │           │    │           └ KV heads and head dim of this layer
               │           │    └ token slot inside the block
               │           └ T_l = 2 (K then V) or 1 (K=V layers: values are the keys' tensor)
               └ block id (the pool hands these out)

A KV-shared layer (Gemma 4's last `num_kv_shared_layers`) stores nothing and
attends over the cache of the layer it reads. Where every layer is stored with
the same geometry and both tensors (Llama, Gemma 3) the region is the familiar
`kv[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`; otherwise
it is a flat tensor that `layer_cache` cuts into each layer's view.

One (layer, block) pair is one contiguous byte range of `layer_block_nbytes(l)`.
A kv_transfer slot holds one block of every stored layer, layer-major
(`slot_nbytes`, layer l at `slot_offset(l)`). A token's slot in a block table is
`block_id * block_size + offset`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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
class LayerKV:
    """What one layer keeps in the cache."""

    num_kv_heads: int
    head_dim: int
    num_tensors: int = 2  # 2: keys then values; 1: one tensor serves as both
    reads_layer: int | None = None  # KV-shared: attends over that layer's cache and stores nothing
    sliding_window: int | None = None  # attends to the last `sliding_window` positions only

    @property
    def stored(self) -> bool:
        return self.reads_layer is None

    def token_elems(self) -> int:
        """Elements one token takes in this layer's cache (0 for a shared layer)."""
        return self.num_tensors * self.num_kv_heads * self.head_dim if self.stored else 0

    def describe(self) -> str:
        if not self.stored:
            return f"<{self.reads_layer}"
        return f"{self.num_tensors}x{self.num_kv_heads}x{self.head_dim}" + (
            f"w{self.sliding_window}" if self.sliding_window else "")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # of every layer when `layers` is not given, else the widest layer's (informative)
    head_dim: int
    dtype: torch.dtype
    # per-layer geometry; () = every layer stores K and V of num_kv_heads x head_dim
    per_layer: tuple[LayerKV, ...] = field(default=())

    def __post_init__(self) -> None:
        layers = self.per_layer or (LayerKV(self.num_kv_heads, self.head_dim),) * self.num_layers
        object.__setattr__(self, "_layers", layers)
        if len(layers) != self.num_layers:
            raise ValueError(f"{len(layers)} layer geometries for {self.num_layers} layers")
        for i, g in enumerate(layers):
            if g.reads_layer is not None and not (0 <= g.reads_layer < i and layers[g.reads_layer].stored):
                raise ValueError(f"layer {i} reads layer {g.reads_layer}, which is not an earlier stored layer")
        offsets, offset = [], 0
        for g in layers:
            offsets.append(offset)
            offset += g.token_elems()
        object.__setattr__(self, "_slot_elem_offsets", tuple(offsets))
        object.__setattr__(self, "_slot_elems", offset * self.block_size)

    @classmethod
    def of(cls, layers: Sequence[LayerKV], num_blocks: int, block_size: int, dtype: torch.dtype) -> KVLayout:
        """The layout of a model's layers (`PagedCausalLM.kv_layers`)."""
        stored = [g for g in layers if g.stored]
        if not stored:
            raise ValueError("a model with no stored KV layer")
        widest = max(stored, key=lambda g: g.num_kv_heads * g.head_dim)
        plain = LayerKV(widest.num_kv_heads, widest.head_dim)
        per_layer = () if all(g == plain for g in layers) else tuple(layers)
        return cls(len(layers), num_blocks, block_size, widest.num_kv_heads, widest.head_dim, dtype, per_layer)

    @staticmethod
    def blocks_for_bytes_of(layers: Sequence[LayerKV], nbytes: int, block_size: int, dtype: torch.dtype) -> int:
        """How many blocks of these layers fit a KV budget of `nbytes`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_block = sum(g.token_elems() for g in layers) * block_size * itemsize
        return nbytes // per_block

    # ---- geometry -----------------------------------------------------------------
    @property
    def layers(self) -> tuple[LayerKV, ...]:
        """Every layer's geometry."""
        return self._layers  # type: ignore[attr-defined,no-any-return]

    @property
    def is_uniform(self) -> bool:
        """Every layer stores K and V of one shape: the cache is one 6-D tensor (`uniform_shape`)."""
        first = self.layers[0]
        return all(g.stored and g.num_tensors == 2 and (g.num_kv_heads, g.head_dim) ==
                   (first.num_kv_heads, first.head_dim) for g in self.layers)

    @property
    def stored_layers(self) -> list[int]:
        return [i for i, g in enumerate(self.layers) if g.stored]

    @property
    def shape(self) -> tuple[int, ...]:
        """[num_layers, num_blocks, 2, block_size, heads, dim] when uniform, else [elements] (flat)."""
        if self.is_uniform:
            return (self.num_layers, self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return (self.num_blocks * self._slot_elems,)  # type: ignore[attr-defined]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def storage_layer(self, layer: int) -> int:
        """The layer whose cache `layer` attends over (itself unless it is KV-shared)."""
        reads = self.layers[layer].reads_layer
        return layer if reads is None else reads

    def layer_block_nbytes(self, layer: int) -> int:
        """Bytes of one block in `layer` (0 for a shared layer)."""
        return self.layers[layer].token_elems() * self.block_size * self.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in one layer, for uniform layouts (else see `layer_block_nbytes`)."""
        assert self.is_uniform, "block_nbytes differs per layer here: use layer_block_nbytes"
        return self.layer_block_nbytes(0)

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's blocks, for uniform layouts."""
        return self.num_blocks * self.block_nbytes

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one block of every stored layer: a kv_transfer slot's KV, a handoff's block."""
        return self._slot_elems * self.itemsize  # type: ignore[attr-defined]

    def slot_offset(self, layer: int) -> int:
        """Where `layer`'s part of a block starts within a slot (layer-major)."""
        return self._slot_elem_offsets[layer] * self.block_size * self.itemsize  # type: ignore[attr-defined]

    def layer_offset(self, layer: int) -> int:
        """Where `layer`'s blocks start in the region."""
        return self.num_blocks * self.slot_offset(layer)

    @property
    def total_nbytes(self) -> int:
        return self.num_blocks * self.slot_nbytes

    def block_range(self, layer: int, block_id: int) -> ByteRange:
        if not (0 <= layer < self.num_layers and 0 <= block_id < self.num_blocks):
            raise IndexError(f"(layer={layer}, block={block_id}) outside {self.num_layers} x {self.num_blocks}")
        if not self.layers[layer].stored:
            raise IndexError(f"layer {layer} is KV-shared: it stores no blocks")
        nbytes = self.layer_block_nbytes(layer)
        return ByteRange(self.layer_offset(layer) + block_id * nbytes, nbytes)

    def block_ranges(self, block_ids: Sequence[int], layers: Iterable[int] | None = None) -> list[ByteRange]:
        """Byte ranges of `block_ids` in each of `layers` (all stored ones by default), layer-major."""
        layer_ids = self.stored_layers if layers is None else [i for i in layers if self.layers[i].stored]
        return [self.block_range(layer, b) for layer in layer_ids for b in block_ids]

    def describe(self) -> str:
        """The geometry as a short string (part of what names a block format)."""
        if self.is_uniform:
            return f"L{self.num_layers}|H{self.num_kv_heads}|D{self.head_dim}"
        return f"L{self.num_layers}|" + ",".join(g.describe() for g in self.layers)

    # ---- tensors --------------------------------------------------------------------
    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The zeroed cache; host memory is backed by huge pages, which transports copy at full speed."""
        if torch.device(device).type == "cpu":
            return host_buffer(self.shape, self.dtype)
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def layer_cache(self, kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) that `layer` attends over, each [num_blocks, block_size, heads, dim] (views of `kv`;
        one tensor twice for a one-tensor layer)."""
        src = self.storage_layer(layer)
        if kv.dim() == 6:
            return kv[src, :, 0], kv[src, :, 1]
        g = self.layers[src]
        elems = self.num_blocks * g.token_elems() * self.block_size
        start = self.layer_offset(src) // self.itemsize
        blocks = kv.narrow(0, start, elems).view(self.num_blocks, g.num_tensors, self.block_size,
                                                 g.num_kv_heads, g.head_dim)
        return blocks[:, 0], blocks[:, g.num_tensors - 1]

    def model_cache(self, kv: torch.Tensor) -> torch.Tensor | list[tuple[torch.Tensor, torch.Tensor]]:
        """What a model's forward reads: the 6-D cache itself where uniform, else each layer's `layer_cache`."""
        return kv if self.is_uniform else [self.layer_cache(kv, layer) for layer in range(self.num_layers)]

    def layer_blocks(self, kv: torch.Tensor, layer: int) -> torch.Tensor:
        """A stored layer's blocks whole: [num_blocks, T, block_size, heads, dim] (a view of `kv`)."""
        assert self.layers[layer].stored, layer
        if kv.dim() == 6:
            return kv[layer]
        g = self.layers[layer]
        elems = self.num_blocks * g.token_elems() * self.block_size
        return kv.narrow(0, self.layer_offset(layer) // self.itemsize, elems).view(
            self.num_blocks, g.num_tensors, self.block_size, g.num_kv_heads, g.head_dim)

    def slot_view(self, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """`layer`'s part of blocks in slot format ([n, slot elements], this dtype) as [n, T, block, heads, dim]."""
        g = self.layers[layer]
        start = self._slot_elem_offsets[layer] * self.block_size  # type: ignore[attr-defined]
        return slots[:, start:start + g.token_elems() * self.block_size].reshape(
            slots.shape[0], g.num_tensors, self.block_size, g.num_kv_heads, g.head_dim)

    @staticmethod
    def blocks_for_bytes(
        nbytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """How many blocks fit a KV budget of `nbytes` across all layers (uniform layers)."""
        per_block = 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return nbytes // (per_block * num_layers)
