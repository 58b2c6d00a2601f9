"""The baton: what a prefill engine hands a decode engine for one request.

A prefill engine stops a request after its first token and copies out the KV
of every prompt token (its blocks, in `KVLayout` order) plus the last-layer
hidden states a draft head needs, for the prompt positions it computed (a
prefix-cache hit skips the rest). A decode engine reserves its own blocks,
copies the KV in, and continues from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.request import TokenLogprobs
from shared.errors import InvalidRequestError
from shared.kv.layout import cdiv


@dataclass
class KVHandoff:
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    block_size: int
    # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]: KV of the prompt tokens
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
        return self.kv.shape[1]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + (
            self.hidden_states.numel() * self.hidden_states.element_size()
        )


def extract_kv(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Copy the blocks holding the first `num_tokens` tokens out of the cache."""
    index = torch.tensor(block_ids[: cdiv(num_tokens, block_size)], dtype=torch.long, device=kv_cache.device)
    return kv_cache.index_select(1, index).cpu()


def inject_kv(kv_cache: torch.Tensor, block_ids: list[int], kv: torch.Tensor) -> None:
    """Write handed-off blocks into this engine's cache at `block_ids`."""
    if kv.shape[0] != kv_cache.shape[0] or kv.shape[2:] != kv_cache.shape[2:]:
        raise InvalidRequestError(
            f"handoff KV shape {tuple(kv.shape)} does not fit this engine's cache {tuple(kv_cache.shape)}"
        )
    index = torch.tensor(block_ids[: kv.shape[1]], dtype=torch.long, device=kv_cache.device)
    kv_cache.index_copy_(1, index, kv.to(kv_cache.device, kv_cache.dtype))
