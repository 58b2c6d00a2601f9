"""Pieces every model here shares: norms, rotary embeddings, weight plumbing.

Numerics follow transformers' reference modules operation for operation
(fp32 norm statistics, rotate-half RoPE with the same inverse-frequency
formula) so our logits match theirs for the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from shared.kv.layout import LayerKV
from shared.ops.attention import AttentionMetadata

if TYPE_CHECKING:
    from shared.models.weight_format import WeightFormat

# attention(query, key, value, k_cache, v_cache, meta, scale, sliding_window) -> out
AttentionFn = Callable[..., torch.Tensor]
# called with the layer index once that layer's KV is written (layer-wise push hook)
LayerDoneFn = Callable[[int], None]


class ModelSpec(Protocol):
    """What the engine reads from a model's spec (`DecoderSpec`, `Gemma4Spec`)."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int

    @property
    def kv_layers(self) -> tuple[LayerKV, ...]: ...  # what each layer keeps in the paged cache


class PagedCausalLM(Protocol):
    """What the runner needs from a model written against the paged KV cache."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    weight_format: WeightFormat  # how the projections are stored (--dtype, --quantization)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: Any,  # KVLayout's 6-D tensor where uniform, else each layer's (keys, values) views
        meta: AttentionMetadata,
        on_layer_done: LayerDoneFn | None = None,
        captured: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...  # [num_tokens, hidden] final-norm hidden states

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, vocab] fp32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: fp32 statistics, weight applied after casting back.

    In fp32 the fused kernel gives the same bits as transformers' four-op form
    (checked in tests); other dtypes take the explicit form to keep its rounding.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_offset(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm, scaled by (1 + w) in fp32; takes (1 + w) precomputed at load."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight_plus_one.shape, weight_plus_one, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight_plus_one.float()).to(x.dtype)


class RotaryEmbedding:
    """Rotate-half RoPE with a cos/sin table precomputed for every position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device | str,
                 inv_freq: torch.Tensor | None = None) -> None:
        """`inv_freq` ([head_dim / 2]): frequencies of another RoPE type (default: the original RoPE's)."""
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (
                torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim))
        inv_freq = inv_freq.to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()  # [max_positions, head_dim]
        self.sin = emb.sin()
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] cos and sin for these positions (once per step, not per layer)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # from RotaryEmbedding.cos_sin
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotate(q, cos_sin), rotate(k, cos_sin)


def rotate(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # from RotaryEmbedding.cos_sin
) -> torch.Tensor:
    """RoPE on one of q or k."""
    cos, sin = cos_sin
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_theta(config: Any, layer_type: str | None = None) -> float:
    """RoPE base of a layer type, from transformers 5 `rope_parameters` or legacy fields."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported yet (only 'default')")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    if layer_type == "sliding_attention" and hasattr(config, "rope_local_base_freq"):
        return float(config.rope_local_base_freq)
    return float(getattr(config, "rope_theta", 10000.0))


def take(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return weights[name]
    except KeyError:
        raise ConfigError(f"checkpoint lacks tensor {name!r}") from None

