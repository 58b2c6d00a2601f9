"""The KV cache layout: one description, used by attention, the block pools, transports and the store.

All layers live in one contiguous region so that a transport registers a
single memory region. Layer-major, so a finished layer's blocks can be shipped
while later layers still compute::

    region = [layer 0 | layer 1 | ... ]          stored layers only, in order
    layer l = [num_blocks(g), T_l, block_size, H_l, D_l]      g = the layer's group
               │              │    │           └ KV heads and head dim of this layer
               │              │    └ token slot inside the block
               │              └ T_l = 2 (K then V) or 1 (one tensor serves both)
               └ block id in the group's pool

Layers are grouped by what their cache keeps (vLLM's hybrid KV cache groups):
group 0 holds the layers that keep every block, and each sliding window gets a
group whose layers keep only the blocks a query can still see; each group has
its own block pool and block tables (shared/engine/hybrid_kv.py). A KV-shared
layer (Gemma 4's last `num_kv_shared_layers`) stores nothing: it attends over
the blocks of the layer it reads. Where every layer stores K and V of one shape
in one group (Llama, Gemma 3) the region is the familiar
`kv[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`; otherwise
it is a flat tensor that `layer_cache` cuts into each layer's view.

One (layer, block) pair is one contiguous byte range of `layer_block_nbytes(l)`.
What a handoff carries and a kv_transfer slot holds is a *unit*: one block of
one group, every stored layer of the group in order (`unit_nbytes(g)`, layer l
at `slot_offset(l)`); `handoff_units` lists the units of a prompt, which for a
sliding group are only the blocks inside the window of the next query.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from shared.kv.cache_dtype import hidden_dtype
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
    sliding_window: int | None = None  # keeps only the blocks of the last `sliding_window` positions

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
class KVGroup:
    """Stored layers that share block tables: those keeping every block, or those of one sliding window."""

    sliding_window: int | None
    layers: tuple[int, ...]

    def first_kept_block(self, next_pos: int, block_size: int) -> int:
        """The first block a query at `next_pos` (or later) can see: blocks before it may be dropped."""
        if self.sliding_window is None:
            return 0
        return max(0, next_pos - self.sliding_window + 1) // block_size


def kv_groups(layers: Sequence[LayerKV]) -> tuple[KVGroup, ...]:
    """The groups of a model's layers: group 0 keeps every block (if any layer does), then one per window."""
    windows = sorted({g.sliding_window for g in layers if g.stored}, key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(w, tuple(i for i, g in enumerate(layers) if g.stored and g.sliding_window == w))
                 for w in windows)


def group_of_layer(layers: Sequence[LayerKV], layer: int) -> int:
    """Index into `kv_groups(layers)` of the group whose blocks `layer` attends over."""
    reads = layers[layer].reads_layer
    src = layer if reads is None else reads
    return next(i for i, g in enumerate(kv_groups(layers)) if src in g.layers)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int  # group 0's (every group's when `group_blocks` is not given)
    block_size: int
    num_kv_heads: int  # of every layer when `per_layer` is not given, else the widest layer's (informative)
    head_dim: int
    dtype: torch.dtype
    # per-layer geometry; () = every layer stores K and V of num_kv_heads x head_dim
    per_layer: tuple[LayerKV, ...] = field(default=())
    group_blocks: tuple[int, ...] = field(default=())  # blocks of each group's pool; () = num_blocks each

    def __post_init__(self) -> None:
        layers = self.per_layer or (LayerKV(self.num_kv_heads, self.head_dim),) * self.num_layers
        if len(layers) != self.num_layers:
            raise ValueError(f"{len(layers)} layer geometries for {self.num_layers} layers")
        for i, g in enumerate(layers):
            if g.reads_layer is not None and not (0 <= g.reads_layer < i and layers[g.reads_layer].stored):
                raise ValueError(f"layer {i} reads layer {g.reads_layer}, which is not an earlier stored layer")
        groups = kv_groups(layers)
        blocks = self.group_blocks or (self.num_blocks,) * len(groups)
        if len(blocks) != len(groups):
            raise ValueError(f"{len(blocks)} group sizes for {len(groups)} groups")
        group_of = {layer: gi for gi, g in enumerate(groups) for layer in g.layers}
        unit_offsets: list[int] = []  # elements of one token into its group's unit
        unit_elems = [0] * len(groups)
        region: list[int] = []  # element offset of each layer's array in the region
        total = 0
        for i, g in enumerate(layers):
            gi = group_of.get(i, 0)
            unit_offsets.append(unit_elems[gi])
            unit_elems[gi] += g.token_elems()
            region.append(total)
            total += blocks[gi] * g.token_elems() * self.block_size
        for name, value in (("_layers", layers), ("_groups", groups), ("_blocks", blocks), ("_group_of", group_of),
                            ("_unit_offsets", tuple(unit_offsets)), ("_unit_elems", tuple(unit_elems)),
                            ("_region", tuple(region)), ("_total_elems", total)):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, layers: Sequence[LayerKV], num_blocks: int | Sequence[int], block_size: int,
           dtype: torch.dtype) -> KVLayout:
        """The layout of a model's layers (`ModelSpec.kv_layers`), `num_blocks` for every group or per group."""
        stored = [g for g in layers if g.stored]
        if not stored:
            raise ValueError("a model with no stored KV layer")
        widest = max(stored, key=lambda g: g.num_kv_heads * g.head_dim)
        plain = LayerKV(widest.num_kv_heads, widest.head_dim)
        per_layer = () if all(g == plain for g in layers) else tuple(layers)
        per_group = (num_blocks,) if isinstance(num_blocks, int) else tuple(num_blocks)
        return cls(len(layers), per_group[0], block_size, widest.num_kv_heads, widest.head_dim, dtype, per_layer,
                   () if isinstance(num_blocks, int) else per_group)

    @staticmethod
    def blocks_for_bytes_of(layers: Sequence[LayerKV], nbytes: int, block_size: int, dtype: torch.dtype) -> int:
        """How many blocks of these layers (every layer in every block) fit a KV budget of `nbytes`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_block = sum(g.token_elems() for g in layers) * block_size * itemsize
        return nbytes // per_block

    # ---- geometry -----------------------------------------------------------------
    @property
    def layers(self) -> tuple[LayerKV, ...]:
        """Every layer's geometry."""
        return self._layers  # type: ignore[attr-defined,no-any-return]

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return self._groups  # type: ignore[attr-defined,no-any-return]

    def group_num_blocks(self, group: int) -> int:
        return self._blocks[group]  # type: ignore[attr-defined,no-any-return]

    def group_of(self, layer: int) -> int:
        """The group whose blocks `layer` attends over."""
        return self._group_of[self.storage_layer(layer)]  # type: ignore[attr-defined,no-any-return]

    @property
    def is_uniform(self) -> bool:
        """Every layer stores K and V of one shape in one group: the cache is one 6-D tensor (`shape`)."""
        first = self.layers[0]
        return len(self.groups) == 1 and all(
            g.stored and g.num_tensors == 2 and (g.num_kv_heads, g.head_dim) == (first.num_kv_heads, first.head_dim)
            for g in self.layers)

    @property
    def stored_layers(self) -> list[int]:
        return [i for i, g in enumerate(self.layers) if g.stored]

    @property
    def shape(self) -> tuple[int, ...]:
        """[num_layers, num_blocks, 2, block_size, heads, dim] when uniform, else [elements] (flat)."""
        if self.is_uniform:
            return (self.num_layers, self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return (self._total_elems,)  # type: ignore[attr-defined]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize  # read per block of every layer of a handoff: no tensor made to ask

    @property
    def hidden_dtype(self) -> torch.dtype:
        """What a handoff's hidden states travel in: the KV dtype, or bf16 beside an 8-bit cache."""
        return hidden_dtype(self.dtype)

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

    def unit_nbytes(self, group: int) -> int:
        """Bytes of one block of `group` in every stored layer of it: a handoff unit."""
        return self._unit_elems[group] * self.block_size * self.itemsize  # type: ignore[attr-defined,no-any-return]

    @property
    def slot_nbytes(self) -> int:
        """Bytes a kv_transfer slot needs to hold any unit (for one group: one block of every stored layer)."""
        return max(self.unit_nbytes(g) for g in range(len(self.groups)))

    def slot_offset(self, layer: int) -> int:
        """Where `layer`'s part of a unit starts (within its group's unit, layer-major)."""
        return self._unit_offsets[layer] * self.block_size * self.itemsize  # type: ignore[attr-defined,no-any-return]

    def layer_offset(self, layer: int) -> int:
        """Where `layer`'s blocks start in the region."""
        return self._region[layer] * self.itemsize  # type: ignore[attr-defined,no-any-return]

    @property
    def total_nbytes(self) -> int:
        return self._total_elems * self.itemsize  # type: ignore[attr-defined,no-any-return]

    def block_range(self, layer: int, block_id: int) -> ByteRange:
        if not self.layers[layer].stored:
            raise IndexError(f"layer {layer} is KV-shared: it stores no blocks")
        if not (0 <= layer < self.num_layers and 0 <= block_id < self.group_num_blocks(self.group_of(layer))):
            raise IndexError(f"(layer={layer}, block={block_id}) outside the cache")
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

    # ---- handoff units -----------------------------------------------------------------
    def handoff_units(self, num_tokens: int) -> list[tuple[int, int]]:
        """(group, block index) of every unit a prompt of `num_tokens` hands off: in each group the blocks
        the next query can see. Full units come first, group by group, then the partial last blocks, so the
        hashed units (`num_hashed_units`) are a prefix."""
        full, last = num_tokens // self.block_size, cdiv(num_tokens, self.block_size)
        units = [(g, i) for g, group in enumerate(self.groups)
                 for i in range(group.first_kept_block(num_tokens, self.block_size), full)]
        units += [(g, i) for g, group in enumerate(self.groups)
                  for i in range(max(full, group.first_kept_block(num_tokens, self.block_size)), last)]
        return units

    def num_hashed_units(self, num_tokens: int) -> int:
        """The leading units of `handoff_units` that are full blocks (named by their prefix hash)."""
        full = num_tokens // self.block_size
        return sum(max(0, full - g.first_kept_block(num_tokens, self.block_size)) for g in self.groups)

    # ---- tensors --------------------------------------------------------------------
    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The zeroed cache; host memory is backed by huge pages, which transports copy at full speed."""
        if torch.device(device).type == "cpu":
            return host_buffer(self.shape, self.dtype)
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def layer_blocks(self, kv: torch.Tensor, layer: int) -> torch.Tensor:
        """A stored layer's blocks whole: [num_blocks(group), T, block_size, heads, dim] (a view of `kv`)."""
        assert self.layers[layer].stored, layer
        if kv.dim() == 6:
            return kv[layer]
        g = self.layers[layer]
        n = self.group_num_blocks(self.group_of(layer))
        return kv.narrow(0, self._region[layer], n * g.token_elems() * self.block_size).view(  # type: ignore[attr-defined]
            n, g.num_tensors, self.block_size, g.num_kv_heads, g.head_dim)

    def layer_cache(self, kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) that `layer` attends over, each [num_blocks, block_size, heads, dim] (views of `kv`;
        one tensor twice for a one-tensor layer)."""
        blocks = self.layer_blocks(kv, self.storage_layer(layer))
        return blocks[:, 0], blocks[:, blocks.shape[1] - 1]

    def model_cache(self, kv: torch.Tensor) -> torch.Tensor | list[tuple[torch.Tensor, torch.Tensor]]:
        """What a model's forward reads: the 6-D cache itself where uniform, else each layer's `layer_cache`."""
        return kv if self.is_uniform else [self.layer_cache(kv, layer) for layer in range(self.num_layers)]

    def slot_view(self, units: torch.Tensor, layer: int) -> torch.Tensor:
        """`layer`'s part of units ([n, >= unit elements], this dtype) as [n, T, block, heads, dim]."""
        g = self.layers[layer]
        start = self._unit_offsets[layer] * self.block_size  # type: ignore[attr-defined]
        return units[:, start:start + g.token_elems() * self.block_size].reshape(
            units.shape[0], g.num_tensors, self.block_size, g.num_kv_heads, g.head_dim)

    @staticmethod
    def blocks_for_bytes(
        nbytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """How many blocks fit a KV budget of `nbytes` across all layers (uniform layers)."""
        per_block = 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return nbytes // (per_block * num_layers)
