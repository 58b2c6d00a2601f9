"""A decoder-only transformer written against the paged KV cache.

One forward runs a flat batch of tokens from many sequences (prefill chunks and
decode tokens mixed); where each token's K/V goes and what it attends to comes
from `AttentionMetadata`. The families differ only in what `DecoderSpec` says
(see `llama.py`, `gemma3.py`):

    x = embed(ids) [* embed_scale]
    per layer:  a = attn(norm_in(x))              q/k norm + RoPE (theta per layer),
                a = norm_attn_out(a)  (sandwich)  sliding window per layer
                x = x + a
                m = mlp(norm_ffn_in(x))           act(gate) * up -> down
                m = norm_ffn_out(m)   (sandwich)
                x = x + m
    hidden = norm_final(x);  logits = hidden @ lm_head.T [softcapped]
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.kv.layout import LayerKV
from shared.models.common import (
    AttentionFn,
    LayerDoneFn,
    RotaryEmbedding,
    apply_rope,
    rms_norm,
    rms_norm_offset,
    take,
)
from shared.models.cpu_layer_loop import CpuLayerLoop
from shared.models.decoder_layer import DecoderLayerWeights, gelu_tanh_mul
from shared.models.weight_format import WeightFormat
from shared.ops.attention import AttentionMetadata, kv_write_index, write_kv
from shared.ops.cpu_attention import write_kv_cpu
from shared.ops.cpu_kernels import cpu_kernels_available
from shared.ops.huge_pages import weights_on_huge_pages
from shared.ops.linear import LinearWeight
from shared.ops.norm_rope_cpu import add_rms_norm_cpu, apply_rope_cpu_, norm_rope_cpu_available, rms_norm_cpu
from shared.ops.silu_mul_cpu import silu_mul_cpu, silu_mul_cpu_available, silu_mul_ref


@dataclass(frozen=True)
class _FusedRope:
    """What the fused RoPE-and-store kernel reads in place of a step's cos/sin: the positions and the tables."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor  # [max_positions, head_dim] fp32
    sin: torch.Tensor


_Rope = tuple[torch.Tensor, torch.Tensor] | _FusedRope  # (cos, sin) of the step's positions, or the fused kernel's


GEMV_ROWS = 16  # triton_gemv.MAX_ROWS (that module imports triton at once: imported only where it runs)


def use_triton_ops(device: torch.device, asked: bool | None) -> bool:
    """The layers' elementwise ops as Triton kernels: where asked (tests, through the interpreter on a CPU),
    else on CUDA unless BATON_TRITON_DECODER_OPS=0."""
    if asked is not None:
        return asked
    return device.type == "cuda" and os.environ.get("BATON_TRITON_DECODER_OPS", "1") != "0"


def use_triton_gemv(asked: bool | None) -> bool:
    """The few-row projections as Triton GEMVs, where a model's layers allow them (see DecoderLM): where asked,
    else unless BATON_TRITON_GEMV=0."""
    if asked is not None:
        return asked
    return os.environ.get("BATON_TRITON_GEMV", "1") != "0"


@dataclass(frozen=True)
class DecoderSpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    attn_scale: float
    layer_sliding_window: tuple[int | None, ...]
    layer_rope_theta: tuple[float, ...]
    max_positions: int
    activation: str = "silu"  # "silu" | "gelu_tanh"
    norm_offset: bool = False  # Gemma: weight applied as (1 + w)
    qk_norm: bool = False
    sandwich_norm: bool = False  # norms after attention and around the MLP (Gemma)
    embed_scale: float | None = None
    tie_word_embeddings: bool = True
    final_logit_softcap: float | None = None

    @property
    def kv_layers(self) -> tuple[LayerKV, ...]:
        """What each layer keeps in the paged cache: K and V of one shape everywhere, every block (a sliding
        layer's old blocks are kept too: one block table serves all layers)."""
        return (LayerKV(self.num_kv_heads, self.head_dim),) * self.num_layers


class DecoderLM:
    """Weights as plain tensors owned here, plus the forward pass."""

    def __init__(
        self,
        spec: DecoderSpec,
        weights: Mapping[str, torch.Tensor],
        attention: AttentionFn,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        decodes: bool = True,  # False (a prefill engine): projections only ever see prompt chunks
        weight_format: WeightFormat | None = None,  # how projections are stored; None = as `dtype`
        triton_ops: bool | None = None,  # the layers' elementwise ops as Triton kernels; None = on CUDA
        triton_gemv: bool | None = None,  # with those, few-row projections as Triton GEMVs; None = where they fit
    ) -> None:
        self.spec = spec
        self.attention = attention
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = spec.num_layers
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size

        def get(name: str) -> torch.Tensor:
            return take(weights, name).to(device=self.device, dtype=dtype).contiguous()

        def get_norm(name: str) -> torch.Tensor:
            # Gemma scales by (1 + w): fold the 1 in once here (in fp32, as transformers does)
            w = take(weights, name).to(device=self.device, dtype=torch.float32)
            return ((1.0 + w) if spec.norm_offset else w).to(dtype).contiguous()

        self.weight_format = weight_format or WeightFormat(dtype)

        def lin(name: str, weight: torch.Tensor, small_batches: bool = decodes) -> LinearWeight:
            # a prefill engine keeps no small-batch copy of its layers' fp32 weights
            return self.weight_format.linear(name, weight, small_batches)

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = lin("lm_head", self.embed if spec.tie_word_embeddings else get("lm_head.weight"), True)
        self.norm_final = get_norm("model.norm.weight")
        self.layers = [self._load_layer(get, get_norm, lin, i) for i in range(spec.num_layers)]
        self.ropes = {
            theta: RotaryEmbedding(spec.head_dim, theta, spec.max_positions, self.device)
            for theta in set(spec.layer_rope_theta)
        }
        # on the CPU in fp32 one C++ op each (the torch forms are mostly dispatch overhead at small batches)
        fused = norm_rope_cpu_available(self.device, dtype)
        self._norm = rms_norm_cpu if fused else rms_norm_offset if spec.norm_offset else rms_norm
        self._rope = apply_rope_cpu_ if fused else apply_rope
        self._add_norm = add_rms_norm_cpu if fused else self._add_norm_ref
        # the keys' two index_put_ as two memcpy a token (any dtype on the CPU)
        self._write_kv = write_kv_cpu if self.device.type == "cpu" and cpu_kernels_available() else write_kv
        # act(gate) * up from the gate_up projection's output; SiLU on the CPU in fp32 in one pass, with torch's
        # bits (checked)
        self._act_mul = (gelu_tanh_mul if spec.activation != "silu"
                         else silu_mul_cpu if silu_mul_cpu_available(self.device, dtype) else silu_mul_ref)
        # on a GPU the ops between projections as one Triton launch each (triton_decoder_ops.py): a CUDA graph's
        # step is ~35 kernels a layer in torch ops, 9 with these
        self.triton_ops = use_triton_ops(self.device, triton_ops)
        self._rope_store: Callable[..., torch.Tensor] | None = None
        if self.triton_ops:
            from shared.ops import triton_decoder_ops as tops

            self._norm = functools.partial(tops.rms_norm, weight_in_fp32=spec.norm_offset)
            self._add_norm = functools.partial(tops.add_rms_norm, weight_in_fp32=spec.norm_offset)
            if spec.activation == "silu":
                self._act_mul = tops.silu_mul
            from shared.ops.triton_attention import paged_attention_triton

            # RoPE straight after the projection (no q/k norm between), and an attention that reads this step's
            # keys from the cache, not from its arguments
            if not spec.qk_norm and attention is paged_attention_triton:
                self._rope_store = tops.rope_store_kv
        # decode steps of a few rows: each projection one Triton GEMV with the norm, residual add or SiLU gate
        # folded in (triton_gemv.py), where a layer is exactly norm -> qkv -> RoPE -> attention -> o -> add ->
        # norm -> gate_up -> SiLU * up -> down -> add, with plain weights in the activation dtype
        self._gemv: Callable[..., torch.Tensor] | None = None
        if (self._rope_store is not None and spec.activation == "silu" and not spec.sandwich_norm
                and use_triton_gemv(triton_gemv)
                and all(p.backend == "torch" and p.weight.dtype == dtype for layer in self.layers
                        for p in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))):
            from shared.ops.triton_gemv import MAX_ROWS, gemv

            assert MAX_ROWS == GEMV_ROWS, (MAX_ROWS, GEMV_ROWS)
            self._gemv = gemv
        if self.device.type == "cpu":  # the packs a decode step streams, on 2 MiB pages (huge_pages.py)
            weights_on_huge_pages([*(w for layer in self.layers for w in (layer.w_qkv, layer.w_o, layer.w_gate_up,
                                                                           layer.w_down)), self.lm_head])
        # decode steps' layers as one C++ call where every op above has its CPU kernel (cpu_layer_loop.py)
        self.cpu_layer_loop = CpuLayerLoop.build(self)

    def _load_layer(self, get, get_norm, lin, i: int) -> DecoderLayerWeights:  # type: ignore[no-untyped-def]
        p = f"model.layers.{i}."
        s = self.spec
        w_qkv = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        w_gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        return DecoderLayerWeights(
            w_qkv=lin(p + "qkv", w_qkv),
            w_o=lin(p + "o", get(p + "self_attn.o_proj.weight")),
            w_gate_up=lin(p + "gate_up", w_gate_up),
            w_down=lin(p + "down", get(p + "mlp.down_proj.weight")),
            norm_in=get_norm(p + "input_layernorm.weight"),
            # Llama names its pre-MLP norm "post_attention_layernorm"; Gemma's is a true post-norm
            norm_ffn_in=get_norm(p + ("pre_feedforward_layernorm" if s.sandwich_norm
                                      else "post_attention_layernorm") + ".weight"),
            norm_attn_out=get_norm(p + "post_attention_layernorm.weight") if s.sandwich_norm else None,
            norm_ffn_out=get_norm(p + "post_feedforward_layernorm.weight") if s.sandwich_norm else None,
            q_norm=get_norm(p + "self_attn.q_norm.weight") if s.qk_norm else None,
            k_norm=get_norm(p + "self_attn.k_norm.weight") if s.qk_norm else None,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        on_layer_done: LayerDoneFn | None = None,
        captured: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The final (normed) hidden states; `captured`'s keys name layers whose outputs (the residual
        stream after that layer, transformers' hidden_states[layer + 1]) are stored into it."""
        x = F.embedding(input_ids, self.embed)
        if self.spec.embed_scale is not None:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        loop = self.cpu_layer_loop
        rows = loop.rows(x.shape[0], meta) if loop is not None and on_layer_done is None and not captured else None
        if loop is not None and rows is not None:  # a decode step on the CPU: every layer in one C++ call
            x, last_mlp = loop.run(x, positions, kv_cache, meta, rows)
            return self._add_norm(x, last_mlp, self.norm_final, self.spec.rms_eps)[1]
        if self._gemv is not None and 0 < x.shape[0] <= GEMV_ROWS and not meta.tree_masks \
                and not meta.bidirectional_spans:
            return self._forward_gemv(x, positions, kv_cache, meta, on_layer_done, captured)
        # RoPE and the KV store fused into one kernel, unless this step's attention may read this step's keys
        # from its arguments (the torch reference's fallbacks: draft trees, images seen both ways)
        fused = self._rope_store is not None and not meta.tree_masks and not meta.bidirectional_spans
        rope: dict[float, _Rope] = {
            theta: _FusedRope(positions, r.cos, r.sin) if fused else r.cos_sin(positions, x.dtype)
            for theta, r in self.ropes.items()}
        kv_index = (kv_write_index(meta.slot_mapping, kv_cache.shape[3])
                    if self._write_kv is write_kv and not fused else None)
        # Each layer hands back its MLP output unadded: the add is fused into the next norm (the next layer's
        # input norm, or the final one). The residual stream after layer i is x + m.
        m: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, m = self._layer(i, layer, x, m, rope[self.spec.layer_rope_theta[i]], kv_cache, meta, kv_index)
            if captured is not None and i in captured:
                captured[i] = x + m
            if on_layer_done is not None:
                on_layer_done(i)
        if m is None:  # no layers
            return self._norm(x, self.norm_final, self.spec.rms_eps)
        return self._add_norm(x, m, self.norm_final, self.spec.rms_eps)[1]

    def _forward_gemv(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, on_layer_done: LayerDoneFn | None,
                      captured: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """`forward`'s layers for a few rows on the GPU: six launches a layer (the GEMV kernel four times)."""
        assert self._gemv is not None and self._rope_store is not None
        s, gemv = self.spec, self._gemv
        q_size = s.num_heads * s.head_dim
        norm = {"eps": s.rms_eps, "norm_in_fp32": s.norm_offset}
        for i, w in enumerate(self.layers):
            rope = self.ropes[s.layer_rope_theta[i]]
            qkv = gemv(x, w.w_qkv.weight, norm_weight=w.norm_in, **norm)
            k_cache, v_cache = kv_cache[i, :, 0], kv_cache[i, :, 1]
            q = self._rope_store(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping,
                                 s.num_heads, s.num_kv_heads)
            # the Triton attention reads this step's keys from the cache; q stands in for its unread k and v
            a = self.attention(q, q, q, k_cache, v_cache, meta, s.attn_scale, s.layer_sliding_window[i])
            x = gemv(a.reshape(-1, q_size), w.w_o.weight, residual=x)
            act = gemv(x, w.w_gate_up.weight, norm_weight=w.norm_ffn_in, gated=True, **norm)
            x = gemv(act, w.w_down.weight, residual=x)
            if captured is not None and i in captured:
                captured[i] = x
            if on_layer_done is not None:
                on_layer_done(i)
        return self._norm(x, self.norm_final, s.rms_eps)

    def _add_norm_ref(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, self._norm(x, weight, eps)

    def _layer(
        self,
        i: int,
        w: DecoderLayerWeights,
        x: torch.Tensor,  # [num_tokens, hidden]
        pending: torch.Tensor | None,  # the previous layer's MLP output, to add to x first (None: layer 0)
        rope: _Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_index: tuple[torch.Tensor, torch.Tensor] | None,  # kv_write_index of the slots, for write_kv
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x after attention, the MLP's output, not yet added)
        s = self.spec
        if pending is None:
            h = self._norm(x, w.norm_in, s.rms_eps)
        else:
            x, h = self._add_norm(x, pending, w.norm_in, s.rms_eps)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = w.w_qkv(h)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        k_cache, v_cache = kv_cache[i, :, 0], kv_cache[i, :, 1]
        if isinstance(rope, _FusedRope):
            # k and v passed on below stay unrotated: the Triton kernel reads every key from the cache
            assert self._rope_store is not None
            q = self._rope_store(qkv, rope.positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping,
                                 s.num_heads, s.num_kv_heads)
        else:
            if w.q_norm is not None and w.k_norm is not None:
                q = self._norm(q, w.q_norm, s.rms_eps)
                k = self._norm(k, w.k_norm, s.rms_eps)
            q, k = self._rope(q, k, rope)
            self._write_kv(k_cache, v_cache, k, v, meta.slot_mapping, kv_index)
        a = self.attention(q, k, v, k_cache, v_cache, meta, s.attn_scale, s.layer_sliding_window[i])
        a = w.w_o(a.reshape(-1, q_size))
        if w.norm_attn_out is not None:
            a = self._norm(a, w.norm_attn_out, s.rms_eps)
        x, h = self._add_norm(x, a, w.norm_ffn_in, s.rms_eps)
        if self._act_mul is silu_mul_cpu:  # the C++ silu with torch's bits: the projection's own form of it
            m = w.w_down(w.w_gate_up.silu_mul(h))
        else:
            m = w.w_down(self._act_mul(w.w_gate_up(h)))
        if w.norm_ffn_out is not None:
            m = self._norm(m, w.norm_ffn_out, s.rms_eps)
        return x, m

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
