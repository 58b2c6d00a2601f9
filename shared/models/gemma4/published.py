"""The text configs of the published Gemma 4 checkpoints, for sizing (KV bytes per token, benchmarks).

No Gemma 4 weights can be downloaded here, so these are the `text_config` fields
of each checkpoint's config.json on the Hugging Face hub (google/gemma-4-<size>-it),
as public code that parses those files quotes them field by field (model cards
and serving frameworks' test fixtures, read 2026-11). Fields not listed take
Gemma4TextConfig's defaults (rope_parameters: sliding default theta 1e4, full
proportional theta 1e6 with partial_rotary_factor 0.25; rms_norm_eps 1e-6;
final_logit_softcapping 30.0 everywhere).
"""

from __future__ import annotations

from typing import Any

_SLIDING, _FULL = "sliding_attention", "full_attention"


def _pattern(num_layers: int, every: int) -> list[str]:
    """Every `every`-th layer full, the rest sliding (Gemma 4's layer_types)."""
    return [_FULL if (i + 1) % every == 0 else _SLIDING for i in range(num_layers)]


PUBLISHED_TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma-4-E2B": dict(
        hidden_size=1536, num_hidden_layers=35, intermediate_size=6144, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
        layer_types=_pattern(35, 5), hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144,
        num_kv_shared_layers=20, use_double_wide_mlp=True, attention_k_eq_v=False,
        max_position_embeddings=131_072, vocab_size=262_144,
    ),
    "gemma-4-E4B": dict(
        hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512,
        layer_types=_pattern(42, 6), hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144,
        num_kv_shared_layers=18, use_double_wide_mlp=False, attention_k_eq_v=False,
        max_position_embeddings=131_072, vocab_size=262_144,
    ),
    "gemma-4-12B": dict(  # gemma4_unified_text: no PLE, no MoE
        model_type="gemma4_unified_text",
        hidden_size=3840, num_hidden_layers=48, intermediate_size=15360, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
        sliding_window=1024, layer_types=_pattern(48, 6), attention_k_eq_v=True, num_kv_shared_layers=0,
        max_position_embeddings=262_144, vocab_size=262_144,
    ),
    "gemma-4-26B-A4B": dict(
        hidden_size=2816, num_hidden_layers=30, intermediate_size=2112, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
        sliding_window=1024, layer_types=_pattern(30, 6), attention_k_eq_v=True, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704, max_position_embeddings=262_144, vocab_size=262_144,
    ),
    "gemma-4-31B": dict(
        hidden_size=5376, num_hidden_layers=60, intermediate_size=21504, num_attention_heads=32,
        num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
        sliding_window=1024, layer_types=_pattern(60, 6), attention_k_eq_v=True, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, max_position_embeddings=262_144, vocab_size=262_144,
    ),
}


def published_text_config(name: str, **overrides: Any) -> Any:
    """The transformers text config of a published size (overrides: e.g. fewer layers for a benchmark)."""
    kw = {**PUBLISHED_TEXT_CONFIGS[name], **overrides}
    if kw.pop("model_type", "gemma4_text") == "gemma4_unified_text":
        from transformers.models.gemma4_unified import Gemma4UnifiedTextConfig

        return Gemma4UnifiedTextConfig(**kw)
    from transformers import Gemma4TextConfig

    kw.setdefault("hidden_size_per_layer_input", 0)
    return Gemma4TextConfig(**kw)
