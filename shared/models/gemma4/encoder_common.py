"""What Gemma 4's vision and audio towers share: clipped projections, norms and reading their weights.

A "clippable" linear (transformers' Gemma4ClippableLinear) clamps its input and
its output to bounds stored in the checkpoint (`input_min` .. `output_max`,
scalars; +-inf when a config turns clipping off, and then absent).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.errors import ConfigError


@dataclass
class ClippedLinear:
    """y = clamp(clamp(x, in_min, in_max) @ w.T, out_min, out_max); bounds None: no clipping."""

    weight: torch.Tensor  # [out, in]
    bounds: tuple[float, float, float, float] | None = None  # (in_min, in_max, out_min, out_max)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.bounds is None:
            return F.linear(x, self.weight)
        in_min, in_max, out_min, out_max = self.bounds
        return torch.clamp(F.linear(torch.clamp(x, in_min, in_max), self.weight), out_min, out_max)


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma4RMSNorm: fp32 statistics (x * (mean(x^2) + eps)^-0.5), scaled by w when it has one."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


class TowerWeights:
    """A tower's tensors under one checkpoint prefix, fetched by relative name with their shapes checked."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, device: torch.device,
                 dtype: torch.dtype) -> None:
        self._weights, self._prefix, self._device, self._dtype = weights, prefix, device, dtype

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        full = self._prefix + name
        tensor = self._weights.get(full)
        if tensor is None:
            raise ConfigError(f"checkpoint lacks tensor {full!r}")
        if shape is not None and tuple(tensor.shape) != shape:
            raise ConfigError(f"checkpoint tensor {full!r} has shape {tuple(tensor.shape)}, the config implies {shape}")
        return tensor.to(device=self._device, dtype=self._dtype).contiguous()

    def has(self, name: str) -> bool:
        return self._prefix + name in self._weights

    def linear(self, name: str, shape: tuple[int, int], clipped: bool) -> ClippedLinear:
        """`name` is the module (`...q_proj`); a clipped one stores its weight under `.linear.`."""
        if not clipped:
            return ClippedLinear(self.get(f"{name}.linear.weight" if self.has(f"{name}.linear.weight")
                                          else f"{name}.weight", shape))
        bounds = tuple(float(self._weights[self._prefix + f"{name}.{b}"]) if self.has(f"{name}.{b}") else default
                       for b, default in (("input_min", -float("inf")), ("input_max", float("inf")),
                                          ("output_min", -float("inf")), ("output_max", float("inf"))))
        return ClippedLinear(self.get(f"{name}.linear.weight", shape), bounds)  # type: ignore[arg-type]
