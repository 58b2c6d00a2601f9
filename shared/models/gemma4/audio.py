"""Gemma 4's audio tower: log-mel frames to soft tokens (transformers' Gemma4AudioModel, a USM conformer).

One clip at a time (its mel frames as the feature extractor made them; frames
past the end of the audio are masked, as transformers masks them)::

    mel [T, 128] ──conv 3x3 /2, LayerNorm, ReLU──► ──conv 3x3 /2, LayerNorm, ReLU──► [T/4, F/4 * C] ──linear──► x
    per layer:
        x = ffn_1(x)                                      x + 0.5 * rms(w2(silu(w1(rms(x)))))
        x = x + rms(attention(rms(x)))                    chunked local attention, see below
        x = lconv(x)                                      x + w_end(silu(rms(causal depthwise conv(glu(w_start(rms(x)))))))
        x = rms_out(ffn_2(x))
    soft tokens = output_proj(x) (with bias), the valid frames only

Attention runs over chunks of `chunk` frames; each chunk's queries see a context of
`left - 1` frames back and `right` ahead (a token sees itself and the `left - 2`
frames before it), with a Transformer-XL relative position bias from sinusoids of
the distance, logits soft-capped; q is scaled per channel by softplus(per_dim_scale).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from shared.models.gemma4.encoder_common import ClippedLinear, TowerWeights, rms

PREFIX = "model.audio_tower."


@dataclass(frozen=True)
class AudioSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    conv_channels: tuple[int, int]
    conv_kernel_size: int
    residual_weight: float
    chunk_size: int
    context_left: int
    context_right: int
    logit_cap: float
    invalid_logit: float
    clipped: bool
    rms_eps: float
    gradient_clipping: float
    output_size: int
    num_mel_bins: int = 128

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def context_size(self) -> int:
        return self.chunk_size + self.context_left - 1 + self.context_right


def audio_spec(config: Any) -> AudioSpec:
    """Spec of a `Gemma4AudioConfig`."""
    if config.hidden_act != "silu":
        raise ConfigError(f"unsupported Gemma 4 audio activation {config.hidden_act!r}")
    channels = tuple(config.subsampling_conv_channels)
    if len(channels) != 2:
        raise ConfigError(f"Gemma 4 audio needs two subsampling convolutions, the config has {len(channels)}")
    return AudioSpec(
        hidden_size=config.hidden_size, num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        conv_channels=(int(channels[0]), int(channels[1])), conv_kernel_size=config.conv_kernel_size,
        residual_weight=config.residual_weight, chunk_size=config.attention_chunk_size,
        context_left=config.attention_context_left, context_right=config.attention_context_right,
        logit_cap=config.attention_logit_cap, invalid_logit=config.attention_invalid_logits_value,
        clipped=bool(config.use_clipped_linears), rms_eps=config.rms_norm_eps,
        gradient_clipping=config.gradient_clipping, output_size=config.output_proj_dims,
    )


def num_soft_tokens(frame_mask: torch.Tensor) -> int:  # [T] bool
    """Soft tokens a clip yields: its valid frames after the two stride-2 subsamplings."""
    return int(frame_mask[::2][::2].sum())


@dataclass
class _FeedForward:
    w1: ClippedLinear
    w2: ClippedLinear
    norm_pre: torch.Tensor
    norm_post: torch.Tensor


@dataclass
class _AudioLayer:
    ffn1: _FeedForward
    ffn2: _FeedForward
    q: ClippedLinear
    k: ClippedLinear
    v: ClippedLinear
    post: ClippedLinear
    relative_k: torch.Tensor  # [hidden, hidden]
    per_dim_scale: torch.Tensor  # [head_dim]
    conv_start: ClippedLinear
    conv_end: ClippedLinear
    conv: torch.Tensor  # [hidden, 1, kernel] depthwise
    conv_norm_pre: torch.Tensor
    conv_norm: torch.Tensor
    norm_pre_attn: torch.Tensor
    norm_post_attn: torch.Tensor
    norm_out: torch.Tensor


class AudioTower:
    """The tower's weights (read from `model.audio_tower.*`) and its forward over one clip."""

    def __init__(self, spec: AudioSpec, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.spec = spec
        self.device, self.dtype = torch.device(device), dtype
        s, w = spec, TowerWeights(weights, PREFIX, self.device, dtype)
        c0, c1 = s.conv_channels
        p = "subsample_conv_projection."
        self.conv0 = (w.get(p + "layer0.conv.weight", (c0, 1, 3, 3)), w.get(p + "layer0.norm.weight", (c0,)))
        self.conv1 = (w.get(p + "layer1.conv.weight", (c1, c0, 3, 3)), w.get(p + "layer1.norm.weight", (c1,)))
        self.input_proj = w.get(p + "input_proj_linear.weight", (s.hidden_size, (c0 // 4) * c1))
        self.layers = [self._layer(w, i) for i in range(s.num_layers)]
        self.output_proj = (w.get("output_proj.weight", (s.output_size, s.hidden_size)),
                            w.get("output_proj.bias", (s.output_size,)))
        # sinusoids of the distances context_size // 2 .. 0, [sin..., cos...]
        n = s.hidden_size // 2
        inv = torch.exp(torch.arange(n) * -(math.log(10000.0) / max(n - 1, 1)))
        dist = torch.arange(s.context_size // 2, -1, -1)[:, None] * inv[None]
        self.rel_pos = torch.cat([dist.sin(), dist.cos()], dim=-1).to(self.device, dtype)  # [P, hidden]

    def _layer(self, w: TowerWeights, i: int) -> _AudioLayer:
        s, p, h = self.spec, f"layers.{i}.", self.spec.hidden_size

        def lin(name: str, shape: tuple[int, int]) -> ClippedLinear:
            return w.linear(p + name, shape, s.clipped)

        def ffn(name: str) -> _FeedForward:
            return _FeedForward(lin(f"{name}.ffw_layer_1", (4 * h, h)), lin(f"{name}.ffw_layer_2", (h, 4 * h)),
                                w.get(p + f"{name}.pre_layer_norm.weight", (h,)),
                                w.get(p + f"{name}.post_layer_norm.weight", (h,)))

        return _AudioLayer(
            ffn1=ffn("feed_forward1"), ffn2=ffn("feed_forward2"),
            q=lin("self_attn.q_proj", (h, h)), k=lin("self_attn.k_proj", (h, h)), v=lin("self_attn.v_proj", (h, h)),
            post=lin("self_attn.post", (h, h)), relative_k=w.get(p + "self_attn.relative_k_proj.weight", (h, h)),
            per_dim_scale=w.get(p + "self_attn.per_dim_scale", (s.head_dim,)),
            conv_start=lin("lconv1d.linear_start", (2 * h, h)), conv_end=lin("lconv1d.linear_end", (h, h)),
            conv=w.get(p + "lconv1d.depthwise_conv1d.weight", (h, 1, s.conv_kernel_size)),
            conv_norm_pre=w.get(p + "lconv1d.pre_layer_norm.weight", (h,)),
            conv_norm=w.get(p + "lconv1d.conv_norm.weight", (h,)),
            norm_pre_attn=w.get(p + "norm_pre_attn.weight", (h,)),
            norm_post_attn=w.get(p + "norm_post_attn.weight", (h,)),
            norm_out=w.get(p + "norm_out.weight", (h,)),
        )

    @torch.inference_mode()
    def forward(
        self,
        mel: torch.Tensor,  # [num_frames, num_mel_bins]
        frame_mask: torch.Tensor,  # [num_frames] bool: frames of real audio
    ) -> torch.Tensor:  # [num_soft_tokens(frame_mask), output_size]: the valid frames' outputs
        s = self.spec
        x, mask = self._subsample(mel.to(self.device, self.dtype), frame_mask.to(self.device))
        bias = self._attention_bias(mask)
        clip = min(s.gradient_clipping, torch.finfo(x.dtype).max)
        for layer in self.layers:
            x = self._feed_forward(layer.ffn1, x, clip)
            a = self._attention(layer, rms(torch.clamp(x, -clip, clip), layer.norm_pre_attn, s.rms_eps), bias)
            x = x + rms(torch.clamp(a, -clip, clip), layer.norm_post_attn, s.rms_eps)
            x = self._light_conv(layer, x, clip)
            x = rms(torch.clamp(self._feed_forward(layer.ffn2, x, clip), -clip, clip), layer.norm_out, s.rms_eps)
        out = F.linear(x, *self.output_proj)
        return out[mask]

    def _subsample(self, mel: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = mel[None, None]  # [1, 1, T, F]
        for weight, norm in (self.conv0, self.conv1):
            x = F.conv2d(x * mask[None, None, :, None], weight, stride=2, padding=1)
            x = F.relu(F.layer_norm(x.permute(0, 2, 3, 1), (weight.shape[0],), norm, None, self.spec.rms_eps))
            x = x.permute(0, 3, 1, 2)
            mask = mask[::2]
        t = x.shape[2]
        x = x.permute(0, 2, 3, 1).reshape(t, -1)  # [T/4, F/4 * C]: frequency-major, channels fastest
        return F.linear(x, self.input_proj), mask

    def _attention_bias(self, mask: torch.Tensor) -> torch.Tensor:  # [blocks, chunk, context] bool: masked out
        """Which context frames each chunk's queries may not see: outside [q - (left - 2), q + right], past
        either end, or not real audio."""
        s = self.spec
        t = mask.shape[0]
        num_blocks = -(-t // s.chunk_size)
        q = torch.arange(num_blocks * s.chunk_size, device=mask.device).view(num_blocks, s.chunk_size, 1)
        kv = (torch.arange(num_blocks, device=mask.device) * s.chunk_size - (s.context_left - 1)).view(-1, 1, 1) \
            + torch.arange(s.context_size, device=mask.device).view(1, 1, -1)
        dist = q - kv
        seen = ((dist >= 0) & (dist < s.context_left - 1)) | ((dist < 0) & (-dist < s.context_right))
        inside = (kv >= 0) & (kv < t) & (q < t)
        valid = mask[kv.clamp(0, t - 1)] & mask[q.clamp(max=t - 1)]
        return ~(seen & inside & valid)

    def _attention(self, layer: _AudioLayer, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        s = self.spec
        t, heads, d, c = x.shape[0], s.num_heads, s.head_dim, s.chunk_size
        q = layer.q(x).float().view(t, heads, d) * ((d**-0.5) / math.log(2)) * F.softplus(layer.per_dim_scale)
        k = layer.k(x).float().view(t, heads, d) * (math.log(1 + math.e) / math.log(2))
        v = layer.v(x).float().view(t, heads, d)
        num_blocks = masked.shape[0]
        q = F.pad(q, (0, 0, 0, 0, 0, num_blocks * c - t)).view(num_blocks, c, heads, d)
        k, v = self._context(k), self._context(v)  # [blocks, context, heads, d]
        rel = F.linear(self.rel_pos, layer.relative_k).view(-1, heads, d).float()  # [P, heads, d]
        qh = q.permute(2, 0, 1, 3)  # [heads, blocks, chunk, d]
        content = qh @ k.permute(2, 0, 3, 1)  # [heads, blocks, chunk, context]
        position = _rel_shift((qh.reshape(heads, -1, d) @ rel.permute(1, 2, 0)).view(heads, num_blocks, c, -1),
                              s.context_size)
        logits = torch.tanh((content + position) / s.logit_cap) * s.logit_cap
        logits = logits.masked_fill(masked[None], s.invalid_logit)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        out = (probs @ v.permute(2, 0, 1, 3)).permute(1, 2, 0, 3).reshape(num_blocks * c, heads * d)[:t]
        return layer.post(out.to(x.dtype))

    def _context(self, x: torch.Tensor) -> torch.Tensor:  # [T, heads, d] -> [blocks, context, heads, d]
        s = self.spec
        x = F.pad(x, (0, 0, 0, 0, s.context_left - 1, s.context_right + s.chunk_size - 1))
        return x.unfold(0, s.context_size, s.chunk_size).movedim(-1, 1).contiguous()

    def _feed_forward(self, ffn: _FeedForward, x: torch.Tensor, clip: float) -> torch.Tensor:
        s = self.spec
        h = ffn.w2(F.silu(ffn.w1(rms(torch.clamp(x, -clip, clip), ffn.norm_pre, s.rms_eps))))
        return x + rms(torch.clamp(h, -clip, clip), ffn.norm_post, s.rms_eps) * s.residual_weight

    def _light_conv(self, layer: _AudioLayer, x: torch.Tensor, clip: float) -> torch.Tensor:
        s = self.spec
        h = F.glu(layer.conv_start(rms(x, layer.conv_norm_pre, s.rms_eps)), dim=-1)  # [T, hidden]
        h = F.conv1d(F.pad(h.T[None], (s.conv_kernel_size - 1, 0)), layer.conv, groups=s.hidden_size)[0].T
        h = F.silu(rms(torch.clamp(h, -clip, clip), layer.conv_norm, s.rms_eps))
        return x + layer.conv_end(h)


def _rel_shift(x: torch.Tensor, context_size: int) -> torch.Tensor:
    """[heads, blocks, chunk, P] position logits by distance to [heads, blocks, chunk, context] by key: the
    Transformer-XL shift (pad, flatten, drop the tail, refold)."""
    heads, blocks, chunk, p = x.shape
    x = F.pad(x, (0, context_size + 1 - p)).view(heads, blocks, chunk * (context_size + 1))
    return x[..., : chunk * context_size].view(heads, blocks, chunk, context_size)
