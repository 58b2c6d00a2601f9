"""Gemma 4 text (`gemma4_text`, and `gemma4_unified_text`, the 12B model's decoder): spec from an HF config.

Every branch of `Gemma4TextConfig` is read into plain per-layer fields here, so
the forward (`text.py`) never looks at the HF config:

    layer_types            sliding / full attention per layer, each type with its own head dim
                           (`global_head_dim` for full layers), KV head count (`per_layer_config`) and
                           RoPE (`rope_parameters[type]`: default, or proportional with a rotated fraction)
    attention_k_eq_v       full layers have no v_proj: values come from the keys' projection
    num_kv_shared_layers   the last N layers attend over the K/V of the last earlier layer of their type
                           and own no cache (transformers' `kv_sharing_modes`: "reuse" -> "store")
    use_double_wide_mlp    KV-shared layers' MLP is twice as wide
    enable_moe_block       a routed expert block runs beside the dense MLP in every layer
    hidden_size_per_layer_input   per-layer input embeddings (PLE) feed a gated residual into each layer
    final_logit_softcapping

`gemma4_unified_text` is the same decoder without PLE and MoE (its config has
neither field), so it takes the same path with both off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import ConfigError
from shared.kv.layout import LayerKV

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class RopeSpec:
    """One layer type's rotary embedding (transformers' `rope_parameters[layer_type]`)."""

    head_dim: int
    theta: float
    rotated_fraction: float = 1.0  # "proportional": the first fraction of each half rotates, the rest stays
    factor: float = 1.0  # "proportional": frequencies divided by this


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert


@dataclass(frozen=True)
class Gemma4LayerSpec:
    layer_type: str  # SLIDING | FULL
    head_dim: int
    num_kv_heads: int
    sliding_window: int | None
    k_eq_v: bool  # no v_proj: values are the keys' projection (normed without scale, no RoPE)
    reads_layer: int | None  # KV-shared: the layer whose K/V this one attends over (it has no k/v weights)
    intermediate_size: int  # the dense MLP's


@dataclass(frozen=True)
class Gemma4Spec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    rms_eps: float
    max_positions: int
    layers: tuple[Gemma4LayerSpec, ...]
    ropes: tuple[tuple[str, RopeSpec], ...]  # (layer type, its RoPE)
    per_layer_input_size: int = 0  # PLE width per layer; 0 = no per-layer inputs
    per_layer_vocab_size: int = 0
    moe: MoESpec | None = None
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = True
    pad_token_id: int = 0  # multimodal placeholders take its per-layer input (the PLE vocabulary may lack theirs)

    @property
    def kv_layers(self) -> tuple[LayerKV, ...]:
        """What each layer keeps in the paged cache: K=V layers one tensor (the values; one_tensor_kv.py), KV-shared
        layers nothing (they read their source), sliding layers only their window's blocks."""
        return tuple(LayerKV(layer.num_kv_heads, layer.head_dim, 1 if layer.k_eq_v else 2, layer.reads_layer,
                             layer.sliding_window) for layer in self.layers)

    def rope(self, layer_type: str) -> RopeSpec:
        return dict(self.ropes)[layer_type]


def rope_spec(params: dict[str, Any] | None, layer_type: str, head_dim: int) -> RopeSpec:
    if params is None:
        raise ConfigError(f"Gemma 4 config has no rope_parameters for {layer_type!r}")
    rope_type = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return RopeSpec(head_dim, theta)
    if rope_type == "proportional":
        return RopeSpec(head_dim, theta, float(params.get("partial_rotary_factor", 1.0)),
                        float(params.get("factor", 1.0)))
    raise ConfigError(f"Gemma 4 rope_type {rope_type!r} ({layer_type}) is not supported (default, proportional)")


def _kv_sources(config: Any, types: list[str]) -> list[int | None]:
    """For each layer, the layer whose K/V it reuses (None: its own), as transformers' kv_sharing_modes."""
    num_layers = len(types)
    num_shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if num_shared == 0:
        return [None] * num_layers
    first_shared = num_layers - num_shared
    if first_shared <= 0:
        raise ConfigError("every layer is KV-shared: that is a drafter's config (gemma4_assistant), not a model's")
    sources: list[int | None] = []
    for i, t in enumerate(types):
        if i < first_shared:
            sources.append(None)
            continue
        producers = [j for j in range(first_shared) if types[j] == t]
        if not producers:
            raise ConfigError(f"KV-shared layer {i} ({t}) has no earlier {t} layer to read")
        sources.append(producers[-1])
    return sources


def _check_supported(config: Any) -> None:
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ConfigError("Gemma 4 with bidirectional attention on all tokens is not a causal LM")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"unsupported Gemma 4 activation {config.hidden_activation!r}")
    if getattr(config, "attention_bias", False):
        raise ConfigError("Gemma 4 checkpoints with attention biases are not supported")


def gemma4_spec(config: Any, max_positions: int) -> Gemma4Spec:
    """Spec of a `Gemma4TextConfig` / `Gemma4UnifiedTextConfig`."""
    _check_supported(config)
    types = list(config.layer_types)
    for t in set(types) - {SLIDING, FULL}:
        raise ConfigError(f"unknown Gemma 4 layer type {t!r}")
    sources = _kv_sources(config, types)
    per_layer = config.per_layer_config
    k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
    double_wide = bool(getattr(config, "use_double_wide_mlp", False))
    layers = tuple(
        Gemma4LayerSpec(
            layer_type=t,
            head_dim=int(per_layer[i].head_dim),
            num_kv_heads=int(per_layer[i].num_key_value_heads),
            sliding_window=int(config.sliding_window) if t == SLIDING else None,
            k_eq_v=k_eq_v and t == FULL,
            reads_layer=sources[i],
            intermediate_size=config.intermediate_size * (2 if double_wide and sources[i] is not None else 1),
        )
        for i, t in enumerate(types)
    )
    ropes = tuple((t, rope_spec(config.rope_parameters.get(t), t, int(per_layer[t].head_dim)))
                  for t in sorted(set(types)))
    moe = None
    if getattr(config, "enable_moe_block", False):
        moe = MoESpec(int(config.num_experts), int(config.top_k_experts), int(config.moe_intermediate_size))
    return Gemma4Spec(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        vocab_size=config.vocab_size,
        rms_eps=config.rms_norm_eps,
        max_positions=max_positions,
        layers=layers,
        ropes=ropes,
        per_layer_input_size=int(getattr(config, "hidden_size_per_layer_input", 0) or 0),
        per_layer_vocab_size=int(getattr(config, "vocab_size_per_layer_input", 0) or 0),
        moe=moe,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        pad_token_id=int(getattr(config, "pad_token_id", 0) or 0),
    )
