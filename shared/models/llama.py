"""Llama family (SmolLM2, Llama 2/3 with default RoPE): spec from an HF config."""

from __future__ import annotations

from typing import Any

from shared.errors import ConfigError
from shared.models.common import rope_theta
from shared.models.decoder import DecoderSpec


def llama_spec(config: Any, max_positions: int) -> DecoderSpec:
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ConfigError("Llama checkpoints with attention/MLP biases are not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported Llama activation {config.hidden_act!r}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_layers = config.num_hidden_layers
    return DecoderSpec(
        model_type="llama",
        num_layers=num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_eps=config.rms_norm_eps,
        attn_scale=head_dim**-0.5,
        layer_sliding_window=(None,) * num_layers,
        layer_rope_theta=(rope_theta(config),) * num_layers,
        max_positions=max_positions,
        activation="silu",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
