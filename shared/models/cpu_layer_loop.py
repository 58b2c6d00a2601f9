"""A decode step's layer loop as one C++ call on the CPU (`shared/ops/csrc/decoder_layers_cpu.cpp`).

From Python a layer is ~20 op calls, each a few microseconds of interpreter and
dispatcher work before its kernel starts: about 2 ms of a 30-layer SmolLM2 step,
11% of it at one row. The C++ loop calls the same kernels in the same order on
the same tensors, so it changes no bit (tested against `DecoderLM._layer`); it
is to the CPU what CUDA graphs are to a GPU's launches.

It is built once per model, from the model's own tensors, where every op of a
layer has its CPU kernel: fp32 activations on the CPU with the fused norm /
RoPE / SiLU ops, the C++ attention (over an fp32 or bf16 cache), and every
projection packed for a GEMV kernel: an fp32 GEMV copy (not in prefill engines,
which keep none), bf16 weights or quantized blocks. A step runs it when the kernels take the step whole:
at most `GEMV_MAX_ROWS` tokens, every sequence's rows for the attention kernel
(decodes and short verify chunks), and nobody asking for per-layer hooks.
`BATON_CPU_LAYER_LOOP=0` turns it off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shared.models.decoder_layer import DecoderLayerWeights, gelu_tanh_mul
from shared.ops.attention import AttentionMetadata
from shared.ops.cpu_attention import cpu_kernel_available, kernel_rows, paged_attention_cpu, write_kv_cpu
from shared.ops.linear import GEMV_MAX_ROWS, LinearWeight
from shared.ops.norm_rope_cpu import add_rms_norm_cpu, apply_rope_cpu_, rms_norm_cpu
from shared.ops.silu_mul_cpu import silu_mul_cpu

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from shared.models.common import RotaryEmbedding


class LoopModel(Protocol):
    """What the loop reads of a model (DecoderLM): its spec, layers, RoPE tables, and the ops its Python
    forward would call (the loop runs only where each is the CPU kernel it calls itself)."""

    spec: Any  # DecoderSpec

    # read-only (properties): a model's list and dict then match the protocol's Sequence and Mapping
    @property
    def layers(self) -> Sequence[DecoderLayerWeights]: ...

    @property
    def ropes(self) -> Mapping[float, RotaryEmbedding]: ...

    attention: Callable[..., Any]
    _norm: Callable[..., Any]
    _add_norm: Callable[..., Any]
    _rope: Callable[..., Any]
    _write_kv: Callable[..., Any]
    _act_mul: Callable[..., Any]


def _projections(layer: DecoderLayerWeights) -> tuple[LinearWeight, ...]:
    """A layer's projections in DecoderLayers' order."""
    return layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down


class CpuLayerLoop:
    """The C++ `DecoderLayers` over one model's layers."""

    def __init__(self, model: LoopModel, gelu_tanh: bool, layers_class: Any = None) -> None:
        """`layers_class`: DecoderLayers from another build of the kernels (bench/kernel_tuning.py times one
        against the other); torch.classes.baton_cpu's by default."""
        s = model.spec
        self.gelu_tanh = gelu_tanh
        packed, out_features, k_blocks, norms = [], [], [], []
        none = torch.empty(0)
        for layer in model.layers:
            for w in _projections(layer):
                assert w.packed is not None
                packed.append(w.packed)
                out_features.append(w.out_features)
                k_blocks.append(w.gemv_k_block)
            # in DecoderLayers::Norm's order
            for n in (layer.norm_in, layer.norm_ffn_in, layer.norm_attn_out, layer.norm_ffn_out, layer.q_norm,
                      layer.k_norm):
                norms.append(none if n is None else n)
        thetas = sorted(model.ropes)
        self._ropes = [model.ropes[t] for t in thetas]
        self._layers = (layers_class or torch.classes.baton_cpu.DecoderLayers)(
            packed, out_features, k_blocks, norms,
            [w or 0 for w in s.layer_sliding_window], [thetas.index(t) for t in s.layer_rope_theta],
            s.num_heads, s.num_kv_heads, s.head_dim, s.rms_eps, s.attn_scale, gelu_tanh,
        )

    @staticmethod
    def build(model: LoopModel) -> CpuLayerLoop | None:
        """The loop for this model, or None where some op of its layers has no CPU kernel here."""
        if (os.environ.get("BATON_CPU_LAYER_LOOP", "1") == "0" or not model.layers
                or model._norm is not rms_norm_cpu or model._add_norm is not add_rms_norm_cpu
                or model._rope is not apply_rope_cpu_ or model._write_kv is not write_kv_cpu
                or model.attention is not paged_attention_cpu or not cpu_kernel_available()
                or model._act_mul not in (silu_mul_cpu, gelu_tanh_mul)):
            return None
        if any(w.packed is None for layer in model.layers for w in _projections(layer)):
            return None
        return CpuLayerLoop(model, gelu_tanh=model._act_mul is gelu_tanh_mul)

    def rows(self, num_tokens: int, meta: AttentionMetadata) -> tuple[torch.Tensor, ...] | None:
        """The attention kernel's row tensors when this step is one the loop runs whole, else None."""
        if not 0 < num_tokens <= GEMV_MAX_ROWS:
            return None
        return kernel_rows(meta, meta.slot_mapping.device)

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
            rows: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, m) after the last layer, as `DecoderLM.forward`'s loop leaves them."""
        cos, sin = [], []
        for rope in self._ropes:
            c, s = rope.cos_sin(positions, x.dtype)
            cos.append(c.squeeze(1))
            sin.append(s.squeeze(1))
        return self._layers.forward(x, cos, sin, kv_cache, meta.slot_mapping, meta.block_tables, *rows)
