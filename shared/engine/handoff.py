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
from shared.kv.layout import KVLayout, cdiv


@dataclass
class KVHandoff:
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    block_size: int
    # [num_blocks, slot elements]: KV of the prompt tokens, each block's every stored layer in KVLayout's slot
    # format (as kv_transfer's slots hold it)
    kv: torch.Tensor
    # [num_hidden_tokens, hidden]: the prompt's LAST num_hidden_tokens positions. Positions
    # served from the prefix cache were not computed, so their hidden states are absent.
    hidden_states: torch.Tensor

    @property
    def hidden_start(self) -> int:
        """Prompt position of hidden_states[0]."""
        return len(self.prompt_token_ids) - self.hidden_states.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + (
            self.hidden_states.numel() * self.hidden_states.element_size()
        )


def extract_kv(layout: KVLayout, kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Copy the blocks holding the first `num_tokens` tokens out of the cache, in slot format."""
    index = torch.tensor(block_ids[: cdiv(num_tokens, layout.block_size)], dtype=torch.long, device=kv_cache.device)
    parts = [layout.layer_blocks(kv_cache, layer).index_select(0, index).reshape(len(index), -1)
             for layer in layout.stored_layers]
    return torch.cat(parts, dim=1).cpu()


def inject_kv(layout: KVLayout, kv_cache: torch.Tensor, block_ids: list[int], kv: torch.Tensor) -> None:
    """Write handed-off blocks (slot format) into this engine's cache at `block_ids`."""
    if kv.dim() != 2 or kv.shape[1] != layout.slot_nbytes // layout.itemsize:
        raise InvalidRequestError(
            f"handoff KV of shape {tuple(kv.shape)} does not fit this engine's blocks of {layout.describe()}"
        )
    index = torch.tensor(block_ids[: kv.shape[0]], dtype=torch.long, device=kv_cache.device)
    kv = kv.to(kv_cache.device, kv_cache.dtype)
    for layer in layout.stored_layers:
        layout.layer_blocks(kv_cache, layer).index_copy_(0, index, layout.slot_view(kv, layer))
