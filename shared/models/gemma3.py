"""Gemma 3 text: spec from an HF config.

What sets it apart from Llama, all read from the config: embeddings scaled by
sqrt(hidden); RMSNorm as (1 + w); q/k RMSNorm per head; norms after attention
and around the MLP ("sandwich"); gelu-tanh MLP; attention scaled by
query_pre_attn_scalar ** -0.5; sliding-window layers (window `sliding_window`,
their own RoPE base) interleaved with global layers, as `layer_types` lists.
"""

from __future__ import annotations

from typing import Any

from shared.errors import ConfigError
from shared.models.common import rope_theta
from shared.models.decoder import DecoderSpec


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", None)
                  or 6)  # Gemma 3's default: every 6th layer is global
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(config.num_hidden_layers)
    ]


def gemma3_spec(config: Any, max_positions: int) -> DecoderSpec:
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ConfigError("Gemma attention logit softcapping is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError("bidirectional Gemma attention is not supported")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"unsupported Gemma activation {config.hidden_activation!r}")
    types = _layer_types(config)
    window = config.sliding_window
    return DecoderSpec(
        model_type="gemma3_text",
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_eps=config.rms_norm_eps,
        attn_scale=config.query_pre_attn_scalar**-0.5,
        layer_sliding_window=tuple(window if t == "sliding_attention" else None for t in types),
        layer_rope_theta=tuple(rope_theta(config, t) for t in types),
        max_positions=max_positions,
        activation="gelu_tanh",
        norm_offset=True,
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=config.hidden_size**0.5,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
    )
