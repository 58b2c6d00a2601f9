"""What a Llama-style decoder layer holds, apart from the model that runs it (DecoderLM, and the C++ layer
loop that takes the same tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.ops.linear import LinearWeight


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 * I] -> [n, I]: Gemma's MLP activation
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@dataclass
class DecoderLayerWeights:
    """One layer's weights: projections (packed as their format says) and norms (None where the family has none)."""

    w_qkv: LinearWeight  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    w_o: LinearWeight  # [hidden, num_heads * head_dim]
    w_gate_up: LinearWeight  # [2 * intermediate, hidden]
    w_down: LinearWeight  # [hidden, intermediate]
    norm_in: torch.Tensor
    norm_ffn_in: torch.Tensor
    norm_attn_out: torch.Tensor | None
    norm_ffn_out: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
