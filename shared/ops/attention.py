"""Paged attention: metadata, KV write, and the torch reference.

One batched forward mixes prefill chunks and decode tokens. The query tokens of
all sequences are packed back to back (`query_start_loc` delimits them); each
sequence's keys are the first `seq_lens[i]` slots of its block table, of which
the last `query_len` were just written by this step. Query token `t` of
sequence `i` sits at position `seq_lens[i] - query_len + t` and attends to keys
at positions `p` with `p <= pos` and, on sliding-window layers,
`p > pos - sliding_window` (the transformers convention).

A draft tree's verification chunk (shared/spec/tree.py) is the exception:
`tree_masks` names its ancestor mask, its queries attend to the context before
the chunk and to their own ancestors only, and it runs with the long chunks.
So is a chunk holding an image whose soft tokens see each other (Gemma 4's
`use_bidirectional_attention: "vision"`): on sliding-window layers a query inside
one of `bidirectional_spans` also sees the later keys of its span (still within
the window: `p > pos - sliding_window`); full layers stay causal, as transformers'.
With `bidirectional_every_layer` (gemma4_unified, whose forward builds Gemma 3's
mask) a query sees its whole span on every layer, past the window too.
The scheduler never splits such a span across chunks.

The reference runs anywhere (the CPU serving path uses it); the Triton kernel in
`triton_attention.py` computes the same thing on CUDA.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shared.kv.cache_dtype import to_cache_dtype
from shared.kv.layout import cdiv


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys are, for one forward pass."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: slot each new token's K/V goes to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    # host-side copies (the planner has them anyway; the reference needs them to split work). In the
    # zero-bubble loop a short chunk's seq_len is known on the host only as an upper bound (its
    # previous step's drafts may be rejected); `positions` and `seq_lens` hold the truth
    query_lens_host: list[int]
    seq_lens_host: list[int]
    positions: torch.Tensor | None = None  # [num_tokens] int64: position of each query token
    # draft-tree verification chunks: sequence index -> [query_len, query_len] bool, True where query i may
    # see the chunk's key j (j is i or an ancestor); `positions` holds the tree depths, not consecutive ones
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # sequence index -> [start, end) positions of the images in its chunk whose tokens attend to each other on
    # sliding-window layers (multimodal prompts of Gemma 4 models that ask for it)
    bidirectional_spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # the spans hold on full layers too, and on sliding ones past the window (gemma4_unified)
    bidirectional_every_layer: bool = False
    # (block_tables, slot_mapping) of each further KV layer group (shared/engine/hybrid_kv.py), as above
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # per-step values every layer shares (index tensors, masks), built once by the first layer
    step_cache: dict[object, object] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)


def kv_write_index(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset in the block) of each slot: where `write_kv` puts each token's key and value."""
    block_idx = slot_mapping // block_size
    return block_idx, slot_mapping - block_idx * block_size


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    index: tuple[torch.Tensor, torch.Tensor] | None = None,  # kv_write_index(slot_mapping), if already made
) -> None:
    """Store this step's keys and values at their slots. A forward makes `index` once for all its layers
    (three ops fewer in each layer of a decode step); it is made inside the forward, so a CUDA graph that
    captures the forward recomputes it from the slots of each replay."""
    if index is None:
        index = kv_write_index(slot_mapping, k_cache.shape[1])
    # a cache of narrower dtype (a bf16 or fp8 KV cache under fp32 activations) stores the keys rounded
    k_cache.index_put_(index, to_cache_dtype(key, k_cache.dtype))
    v_cache.index_put_(index, to_cache_dtype(value, v_cache.dtype))


def _gather_keys(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` keys (or values) of one sequence: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    blocks = cache[block_table_row[:num_blocks].long()]  # [n, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def query_positions(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:  # [num_tokens] int64
    """Every query token's position: `meta.positions` (the truth, also where host lengths are only upper
    bounds) or, when the caller gave none, what the exact host lengths imply."""
    if meta.positions is not None:
        return meta.positions
    return torch.tensor([p for q, s in zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
                         for p in range(s - q, s)], dtype=torch.int64, device=device)


def _position_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Bool mask [..., num_queries, num_keys]: True where the query may attend."""
    mask = key_pos.unsqueeze(-2) <= query_pos.unsqueeze(-1)
    if sliding_window is not None:
        mask &= key_pos.unsqueeze(-2) > (query_pos.unsqueeze(-1) - sliding_window)
    return mask


def _chunk_mask(
    meta: AttentionMetadata, seq: int, q_len: int, s_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Causal (and windowed) mask of one prefill chunk, [q_len, s_len], built once per step; a draft tree's
    chunk sees the context before it and its own ancestors."""
    key = ("chunk", seq, sliding_window)
    mask = meta.step_cache.get(key)
    if mask is None:
        tree = meta.tree_masks.get(seq)
        context = s_len - q_len
        depth = tree.sum(dim=1) - 1 if tree is not None else torch.arange(q_len, device=device)
        mask = _position_mask(context + depth, torch.arange(s_len, device=device), sliding_window)
        if tree is not None:  # ancestors lie within the window: a tree is far shallower than any window
            mask[:, context:] = tree
        every_layer = meta.bidirectional_every_layer
        spans = meta.bidirectional_spans.get(seq) if sliding_window is not None or every_layer else None
        if spans:
            mask |= _span_mask(context + depth, torch.arange(s_len, device=device), spans,
                               None if every_layer else sliding_window)
        meta.step_cache[key] = mask
    return mask  # type: ignore[return-value]


def _span_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, spans: list[tuple[int, int]], sliding_window: int | None
) -> torch.Tensor:  # [num_queries, num_keys] bool
    """Where a query and a key lie in the same span (and the key within the query's window)."""
    mask = torch.zeros((query_pos.shape[0], key_pos.shape[0]), dtype=torch.bool, device=query_pos.device)
    for lo, hi in spans:
        mask |= ((query_pos >= lo) & (query_pos < hi)).unsqueeze(-1) & ((key_pos >= lo) & (key_pos < hi))
    if sliding_window is not None:
        mask &= key_pos.unsqueeze(-2) > (query_pos.unsqueeze(-1) - sliding_window)
    return mask


def _sdpa_grouped(
    query: torch.Tensor,  # [B, Lq, num_heads, head_dim]
    key: torch.Tensor,  # [B, Lk, num_kv_heads, head_dim]
    value: torch.Tensor,  # [B, Lk, num_kv_heads, head_dim]
    mask: torch.Tensor,  # [B, Lq, Lk] bool
    scale: float,
) -> torch.Tensor:  # [B, Lq, num_heads, head_dim]
    """GQA attention by folding each KV head's query group into the query axis.

    Query head h reads KV head h // group (transformers' repeat_kv order). Folding
    avoids materialising repeated K/V and keeps SDPA on its fused CPU kernel.
    """
    b, lq, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    q = query.reshape(b, lq, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(b, num_kv_heads, lq * group, head_dim)
    # keys and values from a bf16 cache under fp32 queries are widened, as the CPU kernel reads them
    k = key.transpose(1, 2).to(query.dtype)
    v = value.transpose(1, 2).to(query.dtype)
    m = mask.repeat_interleave(group, dim=1).unsqueeze(1)  # [B, 1, Lq*group, Lk]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
    out = out.reshape(b, num_kv_heads, lq, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(b, lq, num_heads, head_dim)


# Chunks up to this many query tokens that have earlier context (decodes, speculative verify chunks
# of up to 16 drafts) run together as one padded batch, masked by their true positions; longer ones
# (prefill chunks, whose host lengths are exact) run one by one.
_SHORT_MAX_QUERY = 17


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (this step's keys, already written)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Torch reference of paged attention over mixed prefill and decode sequences.

    Short sequences (decodes and speculative verify chunks) run as one padded batch; each longer
    chunk runs on its own. A chunk with no earlier context attends to this step's own keys
    directly, skipping the gather.
    """
    return paged_attention_split(query, key, value, k_cache, v_cache, meta, scale, sliding_window, _short_batch)


ShortBatchFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None", list[int], list[int],
     torch.Tensor],
    None,
]
# (out [q_len, H, D], query [q_len, H, D], keys, values [s_len, Hkv, D], scale, sliding window or None): a causal
# chunk (query i at position s_len - q_len + i) with no tree or bidirectional span, written into `out`
LongChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"], None]


def split_sequences(meta: AttentionMetadata) -> tuple[list[int], list[int], list[int]]:
    """(short sequences, long chunks, query start of each sequence): the same for every layer of a step."""
    cached = meta.step_cache.get("split")
    if cached is None:
        short_seqs: list[int] = []
        long_seqs: list[int] = []
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            short = (q_len == 1 or (q_len <= _SHORT_MAX_QUERY and s_len > q_len)) and i not in meta.tree_masks \
                and i not in meta.bidirectional_spans
            (short_seqs if short else long_seqs).append(i)
        starts = list(itertools.accumulate(meta.query_lens_host, initial=0))
        cached = meta.step_cache["split"] = (short_seqs, long_seqs, starts)
    return cached  # type: ignore[return-value]


def paged_attention_split(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    short_batch: ShortBatchFn,
    long_chunk: LongChunkFn | None = None,
) -> torch.Tensor:
    """Long chunks one by one (through `long_chunk` when given and the chunk is plainly causal, else SDPA with
    the chunk's mask); the short sequences all at once through `short_batch`."""
    out = torch.empty_like(query)
    short_seqs, long_seqs, starts = split_sequences(meta)
    for i in long_seqs:
        q_len, s_len = meta.query_lens_host[i], meta.seq_lens_host[i]
        lo, hi = starts[i], starts[i] + q_len
        if s_len == q_len and k_cache.dtype == key.dtype:
            keys, values = key[lo:hi], value[lo:hi]
        else:  # also a chunk's own keys when the cache rounds them (bf16): every later read sees those
            keys = _gather_keys(k_cache, meta.block_tables[i], s_len)
            values = _gather_keys(v_cache, meta.block_tables[i], s_len)
        if long_chunk is not None and i not in meta.tree_masks and i not in meta.bidirectional_spans:
            long_chunk(out[lo:hi], query[lo:hi], keys, values, scale, sliding_window)
            continue
        mask = _chunk_mask(meta, i, q_len, s_len, sliding_window, query.device)
        out[lo:hi] = _sdpa_grouped(query[None, lo:hi], keys[None], values[None], mask[None], scale)[0]
    if short_seqs:
        short_batch(query, k_cache, v_cache, meta, scale, sliding_window, short_seqs, starts, out)
    return out


@dataclass
class _ShortGroup:
    """Gather indices and mask of one step's short sequences (shared by all layers)."""

    rows: torch.Tensor  # [B, Lq] query row of each (sequence, query); padding repeats the last row
    valid: torch.Tensor  # [B, Lq] bool: a real query, not padding
    tables: torch.Tensor  # [B, n] block ids, padded
    mask: torch.Tensor  # [B, Lq, n * block_size] bool


def _short_group(
    meta: AttentionMetadata, seq_ids: list[int], starts: list[int], block_size: int,
    sliding_window: int | None, device: torch.device,
) -> _ShortGroup:
    key = ("short", block_size, sliding_window)
    cached = meta.step_cache.get(key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    q_lens = [meta.query_lens_host[i] for i in seq_ids]
    s_lens = [meta.seq_lens_host[i] for i in seq_ids]
    max_q = max(q_lens)
    num_blocks = cdiv(max(s_lens), block_size)
    pad = [[min(t, q - 1) for t in range(max_q)] for q in q_lens]  # query index, padding -> last
    rows = [[starts[i] + t for t in ts] for i, ts in zip(seq_ids, pad, strict=True)]
    row_index = torch.tensor(rows, device=device)
    q_pos = query_positions(meta, device)[row_index]
    idx = torch.tensor(seq_ids, device=device)
    k_pos = torch.arange(num_blocks * block_size, device=device).expand(len(seq_ids), -1)
    group = _ShortGroup(
        rows=row_index,
        valid=torch.tensor([[t < q for t in range(max_q)] for q in q_lens], device=device),
        tables=meta.block_tables[idx, :num_blocks].long(),
        mask=_position_mask(q_pos, k_pos, sliding_window),
    )
    meta.step_cache[key] = group
    return group


def _short_batch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    seq_ids: list[int],
    starts: list[int],
    out: torch.Tensor,
) -> None:
    """All short sequences at once, queries padded to the longest, keys to the longest context."""
    g = _short_group(meta, seq_ids, starts, k_cache.shape[1], sliding_window, query.device)
    b, n = g.tables.shape
    keys = k_cache[g.tables].reshape(b, n * k_cache.shape[1], *k_cache.shape[2:])
    values = v_cache[g.tables].reshape(b, n * v_cache.shape[1], *v_cache.shape[2:])
    attended = _sdpa_grouped(query[g.rows], keys, values, g.mask, scale)  # [B, Lq, num_heads, head_dim]
    out[g.rows[g.valid]] = attended[g.valid]
