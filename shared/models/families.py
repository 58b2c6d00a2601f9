"""Which spec builder and which model class handle which HF `model_type`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shared.errors import ConfigError
from shared.models.checkpoint import check_shapes
from shared.models.common import AttentionFn, ModelSpec, PagedCausalLM
from shared.models.decoder import DecoderLM, DecoderSpec
from shared.models.gemma3 import gemma3_spec
from shared.models.gemma4 import Gemma4Spec, Gemma4TextLM, gemma4_spec
from shared.models.gemma4.weights import expected_shapes as gemma4_shapes
from shared.models.llama import llama_spec
from shared.models.weight_format import WeightFormat

SPEC_BUILDERS: dict[str, Callable[[Any, int], Any]] = {
    "llama": llama_spec,
    "gemma3_text": gemma3_spec,
    "gemma4_text": gemma4_spec,
    "gemma4_unified_text": gemma4_spec,
}


def spec_from_config(config: Any, max_positions: int | None = None) -> Any:
    """The spec (`DecoderSpec` or `Gemma4Spec`) of an HF text config."""
    model_type = getattr(config, "model_type", None)
    builder = SPEC_BUILDERS.get(model_type or "")
    if builder is None:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(SPEC_BUILDERS))}"
        )
    return builder(config, max_positions or config.max_position_embeddings)


def build_model(
    spec: ModelSpec,
    weights: Mapping[str, torch.Tensor],
    attention: AttentionFn,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    decodes: bool = True,
    weight_format: WeightFormat | None = None,  # how projections are stored; None = as `dtype`
) -> PagedCausalLM:
    """The model class of `spec` on these weights (names as the HF *ForCausalLM checkpoints have them), which
    are checked first: a missing or misshapen tensor is a ConfigError naming it."""
    check_shapes(expected_shapes(spec), weights)
    if isinstance(spec, Gemma4Spec):
        return Gemma4TextLM(spec, weights, attention, device=device, dtype=dtype, decodes=decodes,
                            weight_format=weight_format)
    assert isinstance(spec, DecoderSpec), type(spec)
    return DecoderLM(spec, weights, attention, device=device, dtype=dtype, decodes=decodes,
                     weight_format=weight_format)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the model of `spec` reads, with its shape."""
    if isinstance(spec, Gemma4Spec):
        return gemma4_shapes(spec)
    assert isinstance(spec, DecoderSpec), type(spec)
    s = spec
    h, q, kv, inter = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, h), "model.norm.weight": (h,)}
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, h)
    layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    if s.sandwich_norm:
        layer |= {"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}
    if s.qk_norm:
        layer |= {"self_attn.q_norm.weight": (s.head_dim,), "self_attn.k_norm.weight": (s.head_dim,)}
    for i in range(s.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes
