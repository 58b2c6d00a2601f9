"""The Gemma 4 text decoder, written against the paged KV cache.

One forward runs a flat batch of tokens from many sequences, like `DecoderLM`
(shared/models/decoder.py); what differs is all here::

    x = embed(ids) * sqrt(hidden)
    ple = (rms(proj(x) / sqrt(hidden)) + embed_per_layer(ids) * sqrt(ple)) / sqrt(2)   [n, layers, ple]
    per layer i (its type's head dim, KV heads, RoPE and window):
        q = rope(rms_q(q_proj(h)))                 h = rms_in(x)
        k = rope(rms_k(k_proj(h)));  v = rms(v_proj(h))     (v without scale; K=V layers: v_proj = k_proj)
            KV-shared layers compute neither: they attend over the cache of the layer they read
        x = x + rms_attn_out(o_proj(attention(q, k, v)))   scale 1.0
        m = mlp(rms_ffn_in(x))                     gelu-tanh, twice as wide on shared layers (double-wide)
        MoE: m = rms_1(m) + rms_2(experts(rms_pre_2(x), router(x)))
        x = x + rms_ffn_out(m)
        PLE: x = x + rms_ple(proj(gelu(gate(x)) * ple[:, i]))
        x = x * layer_scalar[i]
    hidden = rms_final(x);  logits = softcap(hidden @ embed.T)

Norms are RMSNorm scaled by w (not Gemma 3's 1 + w), as transformers' Gemma4RMSNorm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from shared.kv.layout import LayerKV, group_of_layer
from shared.models.common import AttentionFn, LayerDoneFn, RotaryEmbedding, rms_norm_offset, rotate
from shared.models.gemma4.moe import norm_no_scale
from shared.models.gemma4.one_tensor_kv import DeriveKeys, attend_one_tensor
from shared.models.gemma4.rope import rotary_embedding
from shared.models.gemma4.spec import Gemma4Spec
from shared.models.gemma4.weights import Gemma4LayerWeights, load_weights
from shared.models.weight_format import WeightFormat
from shared.ops.attention import AttentionMetadata, kv_write_index, write_kv
from shared.ops.cpu_attention import write_kv_cpu
from shared.ops.cpu_kernels import cpu_kernels_available

# multimodal soft tokens of a forward: (flat rows [m] int64, their embeddings [m, hidden])
SoftTokens = tuple[torch.Tensor, torch.Tensor]
# per layer, (keys, values) it attends over: [num_blocks, block_size, num_kv_heads, head_dim] each
LayerCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm: fp32 statistics, scaled by w in fp32 (rms_norm_offset's form with w as given)."""
    return rms_norm_offset(x, weight, eps)


class Gemma4TextLM:
    """Weights as plain tensors owned here, plus the forward pass (`PagedCausalLM`)."""

    def __init__(
        self,
        spec: Gemma4Spec,
        weights: Mapping[str, torch.Tensor],
        attention: AttentionFn,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        decodes: bool = True,  # False (a prefill engine): projections only ever see prompt chunks
        weight_format: WeightFormat | None = None,  # how projections are stored; None = as `dtype`
    ) -> None:
        self.weight_format = weight_format or WeightFormat(dtype)
        if self.weight_format.quantization == "gguf":  # GGUF names tensors by llama.cpp's Gemma 4 map, not read yet
            raise ConfigError("--quantization gguf serves Llama and Gemma 3 models; Gemma 4 takes --dtype "
                              "float32 or bfloat16, or --quantization int8 or q4_1")
        self.spec = spec
        self.attention = attention
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = spec.num_layers
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size
        self.kv_layers: tuple[LayerKV, ...] = spec.kv_layers
        self.w = load_weights(spec, weights, self.device, dtype, self.weight_format, decodes)
        self.ropes: dict[str, RotaryEmbedding] = {
            layer_type: rotary_embedding(rope, spec.max_positions, self.device) for layer_type, rope in spec.ropes
        }
        self._write_kv = write_kv_cpu if self.device.type == "cpu" and cpu_kernels_available() else write_kv
        # a multimodal checkpoint's placeholder ids (set_placeholder_ids): embedded as the pad token
        self._placeholders: torch.Tensor | None = None
        # the KV layer group each layer attends in (its block tables: meta's, or meta.group_tables[group - 1])
        self._layer_group = [group_of_layer(self.kv_layers, i) for i in range(spec.num_layers)]
        # layers that some KV-shared layer reads: their K/V of a step is kept for it
        self._sources = {layer.reads_layer for layer in spec.layers if layer.reads_layer is not None}
        self._derive_keys = {i: self._keys_from_values(i) for i, layer in enumerate(spec.layers)
                             if layer.k_eq_v and layer.reads_layer is None}

    def set_placeholder_ids(self, token_ids: Sequence[int]) -> None:
        """A multimodal checkpoint's image/audio/video placeholder ids: embedded (and their per-layer inputs
        taken) as the pad token's wherever they stand, as transformers' Gemma4Model does, a generated one
        included; rows with media behind them get the soft tokens on top."""
        self._placeholders = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device) \
            if token_ids else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor | LayerCaches,  # KVLayout's 6-D tensor, or each layer's views (layer_cache)
        meta: AttentionMetadata,
        on_layer_done: LayerDoneFn | None = None,
        captured: dict[int, torch.Tensor] | None = None,
        soft_tokens: SoftTokens | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The final (normed) hidden states; `captured`'s keys name layers whose outputs are stored into it;
        `soft_tokens` replaces the embeddings of multimodal placeholder rows (multimodal.py)."""
        s, w = self.spec, self.w
        if self._placeholders is not None:
            input_ids = torch.where(torch.isin(input_ids, self._placeholders), s.pad_token_id, input_ids)
        x = F.embedding(input_ids, w.embed) * torch.tensor(s.hidden_size**0.5, dtype=self.dtype)
        if soft_tokens is not None:
            rows, values = soft_tokens
            input_ids = input_ids.index_fill(0, rows, s.pad_token_id)  # their per-layer inputs: the pad token's
            x = x.index_copy(0, rows, values.to(x.dtype))
        ple = self._per_layer_inputs(input_ids, x) if w.ple_projection is not None else None
        cos_sin = {t: rope.cos_sin(positions, x.dtype) for t, rope in self.ropes.items()}
        metas = [meta, *(replace(meta, block_tables=tables, slot_mapping=slots) for tables, slots in meta.group_tables)]
        block_size = cache_block_size(kv_cache)
        kv_index = [kv_write_index(m.slot_mapping, block_size) if self._write_kv is write_kv else None for m in metas]
        step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's K/V of layers others read
        for i, layer in enumerate(w.layers):
            g = self._layer_group[i] if meta.group_tables else 0  # none given: every group uses meta's tables
            a = self._attention(i, layer, _norm(x, layer.norm_in, s.rms_eps), cos_sin[s.layers[i].layer_type],
                                self._layer_cache(kv_cache, i), metas[g], kv_index[g], step_kv)
            x = x + _norm(a, layer.norm_attn_out, s.rms_eps)
            x = x + _norm(self._feed_forward(layer, x), layer.norm_ffn_out, s.rms_eps)
            if ple is not None and layer.ple is not None:
                gated = layer.ple.proj(F.gelu(layer.ple.gate(x), approximate="tanh") * ple[:, i])
                x = x + _norm(gated, layer.ple.norm, s.rms_eps)
            x = x * layer.layer_scalar
            if captured is not None and i in captured:
                captured[i] = x
            if on_layer_done is not None:
                on_layer_done(i)
        return _norm(x, w.norm_final, s.rms_eps)

    def _layer_cache(self, kv_cache: torch.Tensor | LayerCaches, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(kv_cache, torch.Tensor):  # the uniform 6-D cache
            src = self.spec.layers[i].reads_layer
            src = i if src is None else src
            return kv_cache[src, :, 0], kv_cache[src, :, 1]
        return kv_cache[i]

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, num_layers, ple]: each layer's per-layer input."""
        s, w = self.spec, self.w
        assert w.ple_embed is not None and w.ple_projection is not None and w.ple_projection_norm is not None
        shape = (x.shape[0], s.num_layers, s.per_layer_input_size)
        tokens = F.embedding(input_ids, w.ple_embed) * torch.tensor(s.per_layer_input_size**0.5, dtype=self.dtype)
        proj = (w.ple_projection(x) * s.hidden_size**-0.5).reshape(shape)
        proj = _norm(proj, w.ple_projection_norm, s.rms_eps)
        return (proj + tokens.reshape(shape)) * 2.0**-0.5

    def _attention(
        self,
        i: int,
        w: Gemma4LayerWeights,
        h: torch.Tensor,  # [num_tokens, hidden], normed
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        caches: tuple[torch.Tensor, torch.Tensor],  # (k_cache, v_cache) this layer attends over
        meta: AttentionMetadata,
        kv_index: tuple[torch.Tensor, torch.Tensor] | None,
        step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [num_tokens, hidden]
        s, layer = self.spec, self.spec.layers[i]
        d = layer.head_dim
        q = rotate(_norm(w.w_q(h).view(-1, s.num_heads, d), w.q_norm, s.rms_eps), cos_sin)
        if w.w_kv is None:  # KV-shared: the layer it reads ran earlier in this forward
            assert layer.reads_layer is not None
            k, v = step_kv[layer.reads_layer]
        else:
            assert w.k_norm is not None
            kv = w.w_kv(h)
            k_raw = kv[:, : layer.num_kv_heads * d].view(-1, layer.num_kv_heads, d)
            v_raw = k_raw if layer.k_eq_v else kv[:, layer.num_kv_heads * d:].view(-1, layer.num_kv_heads, d)
            k = rotate(_norm(k_raw, w.k_norm, s.rms_eps), cos_sin)
            v = norm_no_scale(v_raw, s.rms_eps)
            # a K=V layer's cache is one tensor: both views are it, and it holds the values
            self._write_kv(caches[0], caches[1], v if layer.k_eq_v else k, v, meta.slot_mapping, kv_index)
            if i in self._sources:
                step_kv[i] = (k, v)
        source = i if layer.reads_layer is None else layer.reads_layer
        if self.kv_layers[source].num_tensors == 1:  # keys rebuilt from the stored values (one_tensor_kv.py)
            return w.w_o(attend_one_tensor(self.attention, q, k, v, caches[1], meta, layer.sliding_window,
                                           self._derive_keys[source]).reshape(-1, s.num_heads * d))
        a = self.attention(q, k, v, caches[0], caches[1], meta, 1.0, layer.sliding_window)
        return w.w_o(a.reshape(-1, s.num_heads * d))

    def _keys_from_values(self, layer: int) -> DeriveKeys:
        """How K=V layer `layer`'s keys follow from its stored values: rope(v * w_k) at their positions."""
        w_k, rope = self.w.layers[layer].k_norm, self.ropes[self.spec.layers[layer].layer_type]
        assert w_k is not None

        def derive(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [n, heads, dim], [n]
            # an fp8 cache's values are widened first (torch promotes no float8); bf16 ones keep bf16 angles
            angles = values.dtype if values.dtype.itemsize > 1 else w_k.dtype
            return rotate(values.to(w_k.dtype) * w_k, rope.cos_sin(positions, angles))

        return derive

    def _feed_forward(self, w: Gemma4LayerWeights, x: torch.Tensor) -> torch.Tensor:  # [n, hidden], unnormed
        eps = self.spec.rms_eps
        gate, up = w.w_gate_up(_norm(x, w.norm_ffn_in, eps)).chunk(2, dim=-1)
        m = w.w_down(F.gelu(gate, approximate="tanh") * up)
        if w.moe is None:
            return m
        weights, index = w.moe.router(x)
        experts = w.moe.experts(_norm(x, w.moe.norm_experts_in, eps), weights, index)
        return _norm(m, w.moe.norm_mlp_out, eps) + _norm(experts, w.moe.norm_experts_out, eps)

    def store_layers(self) -> dict[str, int]:
        """The last stored layer of each layer type: whose cache a gemma4_assistant drafter reads."""
        return {layer.layer_type: i for i, layer in enumerate(self.spec.layers) if layer.reads_layer is None}

    def keys_from_values(self, layer: int) -> DeriveKeys | None:
        """How a stored K=V layer's keys follow from its cache (None: the layer stores its keys)."""
        return self._derive_keys.get(layer)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        logits = self.w.lm_head(hidden).float()
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def cache_block_size(kv_cache: torch.Tensor | LayerCaches) -> int:
    """Tokens per block of the cache a forward got."""
    if isinstance(kv_cache, torch.Tensor):
        return kv_cache.shape[3]
    return kv_cache[0][0].shape[1]
