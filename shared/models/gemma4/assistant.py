"""The Gemma 4 assistant (`gemma4_assistant`): a small drafter that reads the target's own KV cache.

It owns no KV. Each of its layers attends, with its own queries, over the cache
of the target's last stored layer of the same type (transformers'
`shared_kv_states`: the "store" layers of `kv_sharing_modes`). Its input is the
target's embedding of the newest token beside the target's final-norm hidden
state of the position before it; its output is a token and a hidden state in
the target's width, which feeds the next draft::

    x = pre_projection([embed_target(t) * sqrt(H_target), h])          [n, H]
    per layer: q = rope(rms_q(q_proj(rms_in(x))))  at position P (the newest token's, for every draft)
               attention over the target's keys and values of positions < P (sliding layers: the last
               window + 1 of them, as transformers' bidirectional mask flipped onto the past)
               x = Gemma 4 layer (sandwich norms, gelu MLP, layer scalar)
    y = rms_final(x);  logits = lm_head(y) (or its centroid-masked form);  h' = post_projection(y)

The position stays P for every draft of a step and the keys stay the target's:
drafts never see each other, only through the token and hidden state chained in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from shared.models.checkpoint import check_shapes
from shared.models.common import AttentionFn, rms_norm_offset, rotate
from shared.models.gemma4.one_tensor_kv import DeriveKeys, attend_one_tensor
from shared.models.gemma4.rope import rotary_embedding
from shared.models.gemma4.spec import rope_spec
from shared.ops.attention import AttentionMetadata
from shared.ops.linear import LinearWeight


@dataclass
class TargetLayerKV:
    """One of the target's store layers as a drafter layer reads it, for one batch of draft rows."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata  # seq_lens P, positions P - 1: keys of positions < P only
    derive: DeriveKeys | None  # a K=V layer: its keys from the stored values


@dataclass
class _Layer:
    layer_type: str
    head_dim: int
    w_q: LinearWeight
    q_norm: torch.Tensor
    w_o: LinearWeight
    w_gate_up: LinearWeight
    w_down: LinearWeight
    norms: tuple[torch.Tensor, ...]  # input, post-attention, pre-feedforward, post-feedforward
    layer_scalar: torch.Tensor


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_offset(x, weight, eps)


class Gemma4Assistant:
    """Weights of a `Gemma4AssistantForCausalLM` checkpoint and its draft step."""

    def __init__(self, hf_dir: Path, target_embed: torch.Tensor, attention: AttentionFn, max_positions: int,
                 dtype: torch.dtype) -> None:
        """`target_embed`: the target's (unscaled) embedding table [vocab, target_hidden], on its device."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(hf_dir)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{hf_dir} holds no readable assistant config: {e}") from None
        if config.model_type != "gemma4_assistant":
            raise ConfigError(f"{hf_dir} is a {config.model_type!r} checkpoint, not gemma4_assistant")
        text = config.text_config
        self.config = config
        self.eps = float(text.rms_norm_eps)
        self.num_heads = int(text.num_attention_heads)
        self.sliding_window = int(text.sliding_window)
        target_hidden, device = target_embed.shape[1], target_embed.device
        if int(config.backbone_hidden_size) != target_hidden:
            raise ConfigError(f"assistant drafts for a hidden size of {config.backbone_hidden_size}, the target "
                              f"has {target_hidden}")
        self.attention, self.device, self.dtype = attention, device, dtype
        self.target_embed = target_embed
        self.embed_scale = torch.tensor(target_hidden**0.5, dtype=dtype)
        self.head_dims = [int(text.per_layer_config[i].head_dim) for i in range(text.num_hidden_layers)]
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(hf_dir.glob("*.safetensors")):
            weights.update(load_file(f))
        check_shapes(self._shapes(text, target_hidden), weights)
        self.ropes = {t: rotary_embedding(rope_spec(text.rope_parameters[t], t, int(text.per_layer_config[t].head_dim)),
                                          max_positions, device) for t in set(text.layer_types)}
        self._load(text, weights)

    def _shapes(self, text: Any, target_hidden: int) -> dict[str, tuple[int, ...]]:
        h, inter, vocab = int(text.hidden_size), int(text.intermediate_size), int(text.vocab_size)
        shapes: dict[str, tuple[int, ...]] = {"model.norm.weight": (h,), "pre_projection.weight": (h, 2 * target_hidden),
                                              "post_projection.weight": (target_hidden, h),
                                              "model.embed_tokens.weight": (vocab, h)}
        for i, d in enumerate(self.head_dims):
            p = f"model.layers.{i}."
            shapes |= {p + "self_attn.q_proj.weight": (self.num_heads * d, h), p + "self_attn.q_norm.weight": (d,),
                       p + "self_attn.o_proj.weight": (h, self.num_heads * d), p + "mlp.gate_proj.weight": (inter, h),
                       p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
                       p + "layer_scalar": (1,)}
            for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm"):
                shapes[p + n + ".weight"] = (h,)
        return shapes

    def _load(self, text: Any, weights: Mapping[str, torch.Tensor]) -> None:
        def get(name: str) -> torch.Tensor:
            return weights[name].to(self.device, self.dtype).contiguous()

        def lin(*names: str) -> LinearWeight:
            return LinearWeight(torch.cat([get(n) for n in names]))

        self.layers = []
        for i, t in enumerate(text.layer_types):
            p = f"model.layers.{i}."
            self.layers.append(_Layer(
                t, self.head_dims[i], lin(p + "self_attn.q_proj.weight"), get(p + "self_attn.q_norm.weight"),
                lin(p + "self_attn.o_proj.weight"), lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                lin(p + "mlp.down_proj.weight"),
                tuple(get(p + n + ".weight") for n in ("input_layernorm", "post_attention_layernorm",
                                                        "pre_feedforward_layernorm", "post_feedforward_layernorm")),
                get(p + "layer_scalar")))
        self.norm_final = get("model.norm.weight")
        self.pre_projection = lin("pre_projection.weight")
        self.post_projection = lin("post_projection.weight")
        self.lm_weight = get("lm_head.weight") if "lm_head.weight" in weights else get("model.embed_tokens.weight")
        self.lm_head = LinearWeight(self.lm_weight)  # [vocab, hidden]
        self.centroids: LinearWeight | None = None
        if self.config.use_ordered_embeddings:
            self.centroids = lin("masked_embedding.centroids.weight")
            self.token_ordering = weights["masked_embedding.token_ordering"].to(self.device).long()
            self.top_centroids = int(self.config.centroid_intermediate_top_k)

    @property
    def layer_types(self) -> set[str]:
        return {layer.layer_type for layer in self.layers}

    @torch.inference_mode()
    def step(
        self,
        token_ids: torch.Tensor,  # [n] the newest token of each row
        hidden: torch.Tensor,  # [n, target_hidden]: the target's hidden state before it, or the last draft's
        positions: torch.Tensor,  # [n] int64: P, the newest token's position
        target_kv: Mapping[str, TargetLayerKV],  # by layer type
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (next token [n], next hidden state [n, target_hidden])
        embeds = F.embedding(token_ids, self.target_embed) * self.embed_scale
        x = self.pre_projection(torch.cat([embeds, hidden.to(self.dtype)], dim=-1))
        cos_sin = {t: rope.cos_sin(positions, x.dtype) for t, rope in self.ropes.items()}
        for layer in self.layers:
            norm_in, norm_attn_out, norm_ffn_in, norm_ffn_out = layer.norms
            a = self._attend(layer, _norm(x, norm_in, self.eps), cos_sin[layer.layer_type],
                             target_kv[layer.layer_type])
            x = x + _norm(a, norm_attn_out, self.eps)
            gate, up = layer.w_gate_up(_norm(x, norm_ffn_in, self.eps)).chunk(2, dim=-1)
            x = x + _norm(layer.w_down(F.gelu(gate, approximate="tanh") * up), norm_ffn_out, self.eps)
            x = x * layer.layer_scalar
        y = _norm(x, self.norm_final, self.eps)
        return self._best_tokens(y), self.post_projection(y)

    def _attend(self, layer: _Layer, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv: TargetLayerKV) -> torch.Tensor:
        q = rotate(_norm(layer.w_q(h).view(-1, self.num_heads, layer.head_dim), layer.q_norm, self.eps), cos_sin)
        # transformers' sliding mask for the drafter covers window + 1 past positions; masks here count from P - 1
        window = self.sliding_window + 1 if layer.layer_type == "sliding_attention" else None
        if kv.derive is not None:
            a = attend_one_tensor(self.attention, q, q, q, kv.v_cache, kv.meta, window, kv.derive)
        else:  # q stands in for this step's keys and values: rows of one query read the cache alone
            a = self.attention(q, q, q, kv.k_cache, kv.v_cache, kv.meta, 1.0, window)
        return layer.w_o(a.reshape(-1, self.num_heads * layer.head_dim))

    def _best_tokens(self, y: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n] argmax token ids
        if self.centroids is None:
            return self.lm_head(y).argmax(dim=-1)
        # ordered embeddings: only the tokens of the top centroids are scored (the rest are below all of them)
        top = self.centroids(y).topk(self.top_centroids, dim=-1).indices  # [n, top]
        per_centroid = self.token_ordering.numel() // self.centroids.out_features
        candidates = self.token_ordering.view(-1, per_centroid)[top].flatten(1)  # [n, top * per_centroid]
        scores = torch.einsum("nh,nch->nc", y, self.lm_weight[candidates])
        return candidates.gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
