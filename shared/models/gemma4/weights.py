"""Gemma 4 text weights: checkpoint tensors (Gemma4ForCausalLM names) into per-layer holders.

`expected_shapes` lists every tensor with the shape the spec implies; the
loader checks a checkpoint against it before building anything. Norm weights
are used as stored (Gemma 4 scales by w, not 1 + w).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from shared.models.common import take
from shared.models.gemma4.moe import Experts, Router, load_moe
from shared.models.gemma4.spec import Gemma4Spec
from shared.models.weight_format import WeightFormat
from shared.ops.linear import LinearWeight


@dataclass
class PerLayerInput:
    """A layer's share of the per-layer input embeddings (PLE): a gated residual after the MLP."""

    gate: LinearWeight  # [ple, hidden]
    proj: LinearWeight  # [hidden, ple]
    norm: torch.Tensor  # [hidden]


@dataclass
class MoEWeights:
    router: Router
    experts: Experts
    norm_mlp_out: torch.Tensor  # post_feedforward_layernorm_1: on the dense MLP's output
    norm_experts_in: torch.Tensor  # pre_feedforward_layernorm_2
    norm_experts_out: torch.Tensor  # post_feedforward_layernorm_2


@dataclass
class Gemma4LayerWeights:
    w_q: LinearWeight  # [num_heads * head_dim, hidden]
    w_kv: LinearWeight | None  # [(1 or 2) * num_kv_heads * head_dim, hidden]: k (then v); None: KV-shared
    w_o: LinearWeight  # [hidden, num_heads * head_dim]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    w_gate_up: LinearWeight  # [2 * intermediate, hidden]
    w_down: LinearWeight  # [hidden, intermediate]
    norm_in: torch.Tensor
    norm_attn_out: torch.Tensor
    norm_ffn_in: torch.Tensor
    norm_ffn_out: torch.Tensor
    layer_scalar: torch.Tensor  # [1]: the layer's output is scaled by it
    moe: MoEWeights | None
    ple: PerLayerInput | None


@dataclass
class Gemma4Weights:
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: LinearWeight
    norm_final: torch.Tensor
    layers: list[Gemma4LayerWeights]
    ple_embed: torch.Tensor | None  # [per_layer_vocab, num_layers * ple]
    ple_projection: LinearWeight | None  # [num_layers * ple, hidden]
    ple_projection_norm: torch.Tensor | None  # [ple]


def _shapes(spec: Gemma4Spec, i: int) -> dict[str, tuple[int, ...]]:
    """Expected shapes of layer i's tensors, relative to `model.layers.{i}.`."""
    s, layer = spec, spec.layers[i]
    h, d, kv = s.hidden_size, layer.head_dim, layer.num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (s.num_heads * d, h), "self_attn.o_proj.weight": (h, s.num_heads * d),
        "self_attn.q_norm.weight": (d,),
        "mlp.gate_proj.weight": (layer.intermediate_size, h), "mlp.up_proj.weight": (layer.intermediate_size, h),
        "mlp.down_proj.weight": (h, layer.intermediate_size), "layer_scalar": (1,),
    }
    for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm"):
        shapes[f"{n}.weight"] = (h,)
    if layer.reads_layer is None:
        shapes |= {"self_attn.k_proj.weight": (kv * d, h), "self_attn.k_norm.weight": (d,)}
        if not layer.k_eq_v:
            shapes["self_attn.v_proj.weight"] = (kv * d, h)
    if s.moe is not None:
        e, mi = s.moe.num_experts, s.moe.intermediate_size
        shapes |= {"router.scale": (h,), "router.proj.weight": (e, h), "router.per_expert_scale": (e,),
                   "experts.gate_up_proj": (e, 2 * mi, h), "experts.down_proj": (e, h, mi),
                   "post_feedforward_layernorm_1.weight": (h,), "post_feedforward_layernorm_2.weight": (h,),
                   "pre_feedforward_layernorm_2.weight": (h,)}
    if s.per_layer_input_size:
        p = s.per_layer_input_size
        shapes |= {"per_layer_input_gate.weight": (p, h), "per_layer_projection.weight": (h, p),
                   "post_per_layer_input_norm.weight": (h,)}
    return shapes


def expected_shapes(spec: Gemma4Spec) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, with its shape (Gemma4ForCausalLM names)."""
    s = spec
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, s.hidden_size),
                                          "model.norm.weight": (s.hidden_size,)}
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, s.hidden_size)
    if s.per_layer_input_size:
        total = s.num_layers * s.per_layer_input_size
        shapes |= {"model.embed_tokens_per_layer.weight": (s.per_layer_vocab_size, total),
                   "model.per_layer_model_projection.weight": (total, s.hidden_size),
                   "model.per_layer_projection_norm.weight": (s.per_layer_input_size,)}
    for i in range(s.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in _shapes(s, i).items()}
    return shapes


def load_weights(spec: Gemma4Spec, weights: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 weight_format: WeightFormat, decodes: bool = True) -> Gemma4Weights:
    """Device-resident weights (shapes checked by the caller against `expected_shapes`); projections stored as
    `weight_format` says (MoE experts in its dtype, or int8 or q4_1; GGUF's experts stay in `dtype`). `decodes`:
    projections keep their small-batch copy."""

    def get(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return take(weights, name).to(device=device, dtype=as_dtype).contiguous()

    def lin(*names: str) -> LinearWeight:
        return weight_format.linear(names[0], torch.cat([get(n) for n in names]), decodes)

    # the expert banks are stored as the projections are (bf16 weights: bf16 experts, half the bytes a step
    # streams; int8 or q4_1: quantized where the CPU kernels serve them); GGUF's experts stay in `dtype`
    expert_dtype = weight_format.dtype if weight_format.quantization == "none" else dtype

    def get_experts(name: str) -> torch.Tensor:
        return get(name, expert_dtype)

    embed = get("model.embed_tokens.weight")
    layers = [_load_layer(spec, i, get, lin, get_experts, weight_format.quantization)
              for i in range(spec.num_layers)]
    ple = spec.per_layer_input_size > 0
    return Gemma4Weights(
        embed=embed,
        lm_head=weight_format.linear("lm_head", embed if spec.tie_word_embeddings else get("lm_head.weight"), True),
        norm_final=get("model.norm.weight"),
        layers=layers,
        ple_embed=get("model.embed_tokens_per_layer.weight") if ple else None,
        ple_projection=lin("model.per_layer_model_projection.weight") if ple else None,
        ple_projection_norm=get("model.per_layer_projection_norm.weight") if ple else None,
    )


def _load_layer(spec: Gemma4Spec, i: int, get: Callable[[str], torch.Tensor], lin: Callable[..., LinearWeight],
                get_experts: Callable[[str], torch.Tensor], quantization: str = "none") -> Gemma4LayerWeights:
    p = f"model.layers.{i}."
    layer = spec.layers[i]
    shared = layer.reads_layer is not None
    kv_names = [p + "self_attn.k_proj.weight"] + ([] if layer.k_eq_v else [p + "self_attn.v_proj.weight"])
    moe = None
    if spec.moe is not None:
        router, experts = load_moe(get, p, spec.moe, spec.rms_eps, get_experts, quantization)
        moe = MoEWeights(router, experts, get(p + "post_feedforward_layernorm_1.weight"),
                         get(p + "pre_feedforward_layernorm_2.weight"), get(p + "post_feedforward_layernorm_2.weight"))
    ple = None
    if spec.per_layer_input_size:
        ple = PerLayerInput(lin(p + "per_layer_input_gate.weight"), lin(p + "per_layer_projection.weight"),
                            get(p + "post_per_layer_input_norm.weight"))
    return Gemma4LayerWeights(
        w_q=lin(p + "self_attn.q_proj.weight"),
        w_kv=None if shared else lin(*kv_names),
        w_o=lin(p + "self_attn.o_proj.weight"),
        q_norm=get(p + "self_attn.q_norm.weight"),
        k_norm=None if shared else get(p + "self_attn.k_norm.weight"),
        w_gate_up=lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        w_down=lin(p + "mlp.down_proj.weight"),
        norm_in=get(p + "input_layernorm.weight"),
        norm_attn_out=get(p + "post_attention_layernorm.weight"),
        norm_ffn_in=get(p + "pre_feedforward_layernorm.weight"),
        norm_ffn_out=get(p + "post_feedforward_layernorm.weight"),
        layer_scalar=get(p + "layer_scalar"),
        moe=moe,
        ple=ple,
    )
