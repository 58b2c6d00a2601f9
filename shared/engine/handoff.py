"""The baton: what a prefill engine hands a decode engine for one request.

A prefill engine stops a request after its first token and copies out the KV
of every prompt token (its blocks, in `KVLayout`'s slot format) plus the last-layer
hidden states a draft head needs, for the prompt positions it computed (a
prefix-cache hit skips the rest). A decode engine reserves its own blocks,
copies the KV in, and continues from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.request import TokenLogprobs
from shared.errors import InvalidRequestError
from shared.kv.cache_dtype import to_cache_dtype
from shared.kv.layout import KVLayout
from shared.multimodal.items import MediaItem


@dataclass
class KVHandoff:
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    block_size: int
    # [num units, slot elements]: KV of the prompt tokens as KVLayout.handoff_units lists it (a unit: one block
    # of one layer group, its stored layers in order; sliding groups only inside the window), as kv_transfer's
    # slots hold it
    kv: torch.Tensor
    # [num_hidden_tokens, hidden]: the prompt's LAST num_hidden_tokens positions. Positions
    # served from the prefix cache were not computed, so their hidden states are absent.
    hidden_states: torch.Tensor
    media: tuple[MediaItem, ...] = ()  # the prompt's images and audio (shared/multimodal/items.py)

    @property
    def hidden_start(self) -> int:
        """Prompt position of hidden_states[0]."""
        return len(self.prompt_token_ids) - self.hidden_states.shape[0]

    @property
    def num_units(self) -> int:
        return self.kv.shape[0]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + (
            self.hidden_states.numel() * self.hidden_states.element_size()
        )


def extract_kv(layout: KVLayout, kv_cache: torch.Tensor, tables: list[list[int]], num_tokens: int) -> torch.Tensor:
    """Copy the units (KVLayout.handoff_units) of a prompt of `num_tokens` out of the cache: [units, slot elems].
    `tables`: the request's block table in each layer group."""
    units = layout.handoff_units(num_tokens)
    out = torch.zeros((len(units), layout.slot_nbytes // layout.itemsize), dtype=layout.dtype)
    for g, group in enumerate(layout.groups):
        rows = [r for r, (unit_group, _) in enumerate(units) if unit_group == g]
        if not rows:
            continue
        index = torch.tensor([tables[g][units[r][1]] for r in rows], dtype=torch.long, device=kv_cache.device)
        parts = [layout.layer_blocks(kv_cache, layer).index_select(0, index).reshape(len(rows), -1)
                 for layer in group.layers]
        data = torch.cat(parts, dim=1).cpu()
        out[rows, : data.shape[1]] = data
    return out


def check_handoff_kv(layout: KVLayout, kv: torch.Tensor, num_tokens: int) -> list[tuple[int, int]]:
    """The prompt's units (`KVLayout.handoff_units`), or refuse handed-off KV that is not `extract_kv`'s format
    for this layout (called before any block is held)."""
    units = layout.handoff_units(num_tokens)
    if kv.dim() != 2 or kv.shape[0] != len(units) or kv.shape[1] != layout.slot_nbytes // layout.itemsize:
        raise InvalidRequestError(
            f"handoff KV of shape {tuple(kv.shape)} does not fit this engine's blocks of {layout.describe()}"
        )
    return units


def inject_kv(layout: KVLayout, kv_cache: torch.Tensor, tables: list[list[int]], kv: torch.Tensor,
              num_tokens: int) -> None:
    """Write handed-off units (`extract_kv`'s format) into this engine's blocks (`tables`, one per group)."""
    units = check_handoff_kv(layout, kv, num_tokens)
    kv = to_cache_dtype(kv.to(kv_cache.device), kv_cache.dtype)
    for g, group in enumerate(layout.groups):
        rows = [r for r, (unit_group, _) in enumerate(units) if unit_group == g]
        if not rows:
            continue
        index = torch.tensor([tables[g][units[r][1]] for r in rows], dtype=torch.long, device=kv_cache.device)
        data = kv[rows]
        for layer in group.layers:
            blocks, src = layout.layer_blocks(kv_cache, layer), layout.slot_view(data, layer)
            if blocks.dtype.itemsize == 1:  # torch has no index_copy_ for float8: the same bytes as uint8
                blocks, src = blocks.view(torch.uint8), src.view(torch.uint8)
            blocks.index_copy_(0, index, src)
