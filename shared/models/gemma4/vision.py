"""Gemma 4's vision tower: image patches to soft tokens (transformers' Gemma4VisionModel).

Images as the image processor cut them (no padding, so no padding mask;
transformers pads a batch to its longest image and masks). A batch of images is
one run of rows: every projection and MLP over all of them at once, attention
and pooling over each image's own rows::

    patches [n, 3 * p * p] in [0, 1]
      x = input_proj(2 * patches - 1) + pos_x[col] + pos_y[row]          learned 2-D position table
      per layer (bidirectional over the image's patches, scale 1.0):
        q, k = rope2d(rms_q(q_proj(h))), rope2d(rms_k(k_proj(h)))      h = rms_in(x)
        v = rms(v_proj(h))                                              (no scale)
        x = x + rms_attn_out(o_proj(attention(q, k, v)))
        x = x + rms_ffn_out(down(gelu_tanh(gate(rms_ffn_in(x))) * up(.)))
      pool: mean over each k x k cell of patches (k = pooling_kernel_size), row-major cells
      soft tokens = pooled * sqrt(hidden)   (fp32), standardized when the config says so

2-D RoPE (axial): the first half of each head rotates by the patch's column, the
second half by its row, each half a rotate-half RoPE over head_dim / 2 channels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from shared.models.gemma4.encoder_common import ClippedLinear, TowerWeights, rms

PREFIX = "model.vision_tower."
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q, k, v [n, heads, dim] -> same


@dataclass(frozen=True)
class VisionSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rope_theta: float
    clipped: bool
    standardize: bool


def vision_spec(config: Any) -> VisionSpec:
    """Spec of a `Gemma4VisionConfig`."""
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"Gemma 4 vision rope_type {rope.get('rope_type')!r} is not supported (axial)")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ConfigError(f"unsupported Gemma 4 vision activation {config.hidden_activation!r}")
    if getattr(config, "attention_bias", False):
        raise ConfigError("Gemma 4 vision towers with attention biases are not supported")
    return VisionSpec(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, rms_eps=config.rms_norm_eps,
        patch_size=config.patch_size, pooling_kernel_size=config.pooling_kernel_size,
        position_embedding_size=config.position_embedding_size, rope_theta=float(rope.get("rope_theta", 100.0)),
        clipped=bool(config.use_clipped_linears), standardize=bool(config.standardize),
    )


@dataclass
class _VisionLayer:
    q: ClippedLinear
    k: ClippedLinear
    v: ClippedLinear
    o: ClippedLinear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate: ClippedLinear
    up: ClippedLinear
    down: ClippedLinear
    norm_in: torch.Tensor
    norm_attn_out: torch.Tensor
    norm_ffn_in: torch.Tensor
    norm_ffn_out: torch.Tensor


class VisionTower:
    """The tower's weights (read from `model.vision_tower.*`) and its forward over one image or a batch."""

    def __init__(self, spec: VisionSpec, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.spec = spec
        self.device, self.dtype = torch.device(device), dtype
        s, w = spec, TowerWeights(weights, PREFIX, self.device, dtype)
        patch_dim = 3 * s.patch_size**2
        self.input_proj = w.get("patch_embedder.input_proj.weight", (s.hidden_size, patch_dim))
        self.position_table = w.get("patch_embedder.position_embedding_table",
                                    (2, s.position_embedding_size, s.hidden_size))
        self.layers = [self._layer(w, i) for i in range(s.num_layers)]
        self.std = (w.get("std_bias", (s.hidden_size,)).float(), w.get("std_scale", (s.hidden_size,)).float()) \
            if s.standardize else None
        half = s.head_dim // 2  # each axis rotates half of a head: inv_freq over half // 2 pairs
        self.inv_freq = (1.0 / (s.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))).to(self.device)

    def _layer(self, w: TowerWeights, i: int) -> _VisionLayer:
        s, p = self.spec, f"encoder.layers.{i}."
        h, q_out, kv_out = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def lin(name: str, shape: tuple[int, int]) -> ClippedLinear:
            return w.linear(p + name, shape, s.clipped)

        return _VisionLayer(
            q=lin("self_attn.q_proj", (q_out, h)), k=lin("self_attn.k_proj", (kv_out, h)),
            v=lin("self_attn.v_proj", (kv_out, h)), o=lin("self_attn.o_proj", (h, q_out)),
            q_norm=w.get(p + "self_attn.q_norm.weight", (s.head_dim,)),
            k_norm=w.get(p + "self_attn.k_norm.weight", (s.head_dim,)),
            gate=lin("mlp.gate_proj", (s.intermediate_size, h)), up=lin("mlp.up_proj", (s.intermediate_size, h)),
            down=lin("mlp.down_proj", (h, s.intermediate_size)),
            norm_in=w.get(p + "input_layernorm.weight", (h,)),
            norm_attn_out=w.get(p + "post_attention_layernorm.weight", (h,)),
            norm_ffn_in=w.get(p + "pre_feedforward_layernorm.weight", (h,)),
            norm_ffn_out=w.get(p + "post_feedforward_layernorm.weight", (h,)),
        )

    def forward(
        self,
        patches: torch.Tensor,  # [num_patches, 3 * patch_size**2], pixel values in [0, 1]
        positions: torch.Tensor,  # [num_patches, 2] int64: (column, row) of each patch
    ) -> torch.Tensor:  # [num_patches / pooling_kernel_size**2, hidden] fp32: the image's soft tokens
        return self.forward_many([(patches, positions)])[0]

    @torch.inference_mode()
    def forward_many(
        self,
        images: Sequence[tuple[torch.Tensor, torch.Tensor]],  # (patches [n_i, 3 * p * p], positions [n_i, 2])
    ) -> list[torch.Tensor]:  # per image [n_i / pooling_kernel_size**2, hidden] fp32
        s = self.spec
        k = s.pooling_kernel_size
        for patches, _ in images:
            if patches.shape[0] % (k * k):
                raise ConfigError(f"{patches.shape[0]} patches do not pool into {k}x{k} cells")
        sizes = [p.shape[0] for p, _ in images]
        patches = torch.cat([p for p, _ in images]).to(self.device, self.dtype)
        positions = torch.cat([q for _, q in images]).to(self.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # each image on its own
            return torch.cat([_sdpa(qi, ki, vi, None) for qi, ki, vi in
                              zip(q.split(sizes), k.split(sizes), v.split(sizes), strict=True)])

        x = self._encode(patches, positions, attend)
        return [self._soft_tokens(_pool(xi, pi, k) if k > 1 else xi)
                for xi, pi in zip(x.split(sizes), positions.split(sizes), strict=True)]

    def forward_padded(
        self,
        patches: torch.Tensor,  # [N, 3 * p * p] one image, its real patches first, then padding
        positions: torch.Tensor,  # [N, 2] (column, row); anything in the padding rows
        key_mask: torch.Tensor,  # [N] bool: the real patches
        cell_rows: torch.Tensor,  # [N / k**2, k**2] int64: each pooling cell's patch rows (padding cells: any)
    ) -> torch.Tensor:  # [N / k**2, hidden] fp32; the first (real patches / k**2) rows are the soft tokens
        """One image padded to a fixed size, without a host synchronization: what a CUDA graph captures
        (vision_graphs.py). Padding keys are masked; padding rows feed no real cell."""
        mask = key_mask[None, None, None, :]
        x = self._encode(patches, positions, lambda q, k, v: _sdpa(q, k, v, mask))
        pooled = x[cell_rows].float().mean(dim=1).to(x.dtype) if self.spec.pooling_kernel_size > 1 else x
        return self._soft_tokens(pooled)

    def _encode(self, patches: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:  # [n, hidden]
        """The patch embedding and every layer; `attend(q, k, v)` over [n, heads, head_dim] rows."""
        s = self.spec
        x = F.linear(2 * (patches - 0.5), self.input_proj)
        x = x + self.position_table[0][positions[:, 0]] + self.position_table[1][positions[:, 1]]
        cos_sin = self._rope(positions)
        for layer in self.layers:
            x = x + rms(self._attention(layer, rms(x, layer.norm_in, s.rms_eps), cos_sin, attend),
                        layer.norm_attn_out, s.rms_eps)
            h = rms(x, layer.norm_ffn_in, s.rms_eps)
            m = layer.down(F.gelu(layer.gate(h), approximate="tanh") * layer.up(h))
            x = x + rms(m, layer.norm_ffn_out, s.rms_eps)
        return x

    def _soft_tokens(self, pooled: torch.Tensor) -> torch.Tensor:  # [cells, hidden] fp32
        out = pooled.float() * self.spec.hidden_size**0.5
        if self.std is not None:
            out = (out - self.std[0]) * self.std[1]
        return out

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # each [n, 1, head_dim]
        """cos and sin per channel: [col, col, row, row] frequency blocks, as transformers lays them out."""
        freqs = positions[..., None].float() * self.inv_freq  # [n, 2, head_dim / 4]
        fx, fy = freqs[:, 0], freqs[:, 1]
        angles = torch.cat([fx, fx, fy, fy], dim=-1)
        return angles.cos().to(self.dtype)[:, None], angles.sin().to(self.dtype)[:, None]

    def _attention(self, layer: _VisionLayer, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   attend: Attend) -> torch.Tensor:  # [n, hidden]
        s = self.spec
        n = h.shape[0]
        q = _rope2d(rms(layer.q(h).view(n, s.num_heads, s.head_dim), layer.q_norm, s.rms_eps), cos_sin)
        k = _rope2d(rms(layer.k(h).view(n, s.num_kv_heads, s.head_dim), layer.k_norm, s.rms_eps), cos_sin)
        v = rms(layer.v(h).view(n, s.num_kv_heads, s.head_dim), None, s.rms_eps)
        group = s.num_heads // s.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return layer.o(attend(q, k, v).reshape(n, s.num_heads * s.head_dim))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: torch.Tensor | None) -> torch.Tensor:  # [n, heads, dim] each; bidirectional, scale 1.0
    """As one 4-D batch ([1, heads, n, dim]): 3-D inputs keep SDPA off its fused CUDA kernels."""
    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)[None]

    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), attn_mask=mask, scale=1.0)
    return out[0].transpose(0, 1)


def _rope2d(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # [n, heads, dim]
    """Rotate-half RoPE on each half of the head separately (columns, then rows)."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    parts = []
    for lo in (0, half):
        xp, c, sn = x[..., lo:lo + half], cos[..., lo:lo + half], sin[..., lo:lo + half]
        rotated = torch.cat((-xp[..., half // 2:], xp[..., : half // 2]), dim=-1)
        parts.append(xp * c + rotated * sn)
    return torch.cat(parts, dim=-1)


def _pool(x: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Mean of each k x k cell of patches; cells in row-major order (column fastest)."""
    cells_per_row = (int(positions[:, 0].max()) + 1) // k
    cell = torch.div(positions[:, 0], k, rounding_mode="floor") + cells_per_row * torch.div(
        positions[:, 1], k, rounding_mode="floor")
    num_cells = x.shape[0] // (k * k)
    weights = F.one_hot(cell, num_cells).float() / (k * k)  # [n, cells]
    return (weights.T @ x.float()).to(x.dtype)


def cell_rows(positions: torch.Tensor, k: int) -> torch.Tensor:  # [n / k**2, k**2] int64
    """The patch rows of each k x k pooling cell, cells in `_pool`'s order (what `forward_padded` gathers)."""
    cells_per_row = (int(positions[:, 0].max()) + 1) // k
    cell = torch.div(positions[:, 0], k, rounding_mode="floor") + cells_per_row * torch.div(
        positions[:, 1], k, rounding_mode="floor")
    return torch.argsort(cell, stable=True).view(-1, k * k)
