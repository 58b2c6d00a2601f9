"""Gemma 4's rotary embeddings: the original RoPE on sliding layers, "proportional" RoPE on full ones.

Proportional RoPE (transformers' `_compute_proportional_rope_parameters`) rotates
only the first `rotated_fraction` of each half of the head; the remaining
frequencies are zero, so cos = 1 and sin = 0 there and those dimensions pass
through unchanged. The frequency formula keeps the whole head dim as its
denominator, as transformers does.
"""

from __future__ import annotations

import torch

from shared.models.common import RotaryEmbedding
from shared.models.gemma4.spec import RopeSpec


def inv_freq(rope: RopeSpec) -> torch.Tensor:  # [head_dim / 2] fp32
    head_dim = rope.head_dim
    num_rotated = int(rope.rotated_fraction * head_dim // 2)
    exponents = torch.arange(0, 2 * num_rotated, 2, dtype=torch.int64).to(torch.float) / head_dim
    freqs = 1.0 / (rope.theta ** exponents)
    freqs = torch.cat((freqs, torch.zeros(head_dim // 2 - num_rotated, dtype=torch.float32)))
    return freqs / rope.factor


def rotary_embedding(rope: RopeSpec, max_positions: int, device: torch.device | str) -> RotaryEmbedding:
    """cos/sin tables of one layer type for every position."""
    return RotaryEmbedding(rope.head_dim, rope.theta, max_positions, device, inv_freq=inv_freq(rope))
