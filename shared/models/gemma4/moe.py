"""Gemma 4's mixture-of-experts block: a router and a bank of gelu-tanh experts.

In every MoE layer the block runs beside the dense MLP (text.py adds the two)::

    router(x):   p = softmax(proj(rms(x) * scale / sqrt(hidden)))       fp32, over num_experts
                 w, e = top_k(p);  w = w / sum(w) * per_expert_scale[e]  [n, top_k] each
    experts(h):  out[t] = sum_j w[t, j] * down_e(gelu(gate_e(h[t])) * up_e(h[t]))   e = e[t, j]

The experts run grouped: the (token, expert) pairs are sorted by expert once,
and each expert that got tokens multiplies all of them in one matmul over a
contiguous slice, so the Python loop is over experts hit (at most num_experts),
never over tokens. The weighted rows are summed back per token in one
`index_add_`, in expert order per token, as transformers' loop adds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.models.gemma4.spec import MoESpec


def norm_no_scale(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., d]: RMSNorm without a weight
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


@dataclass
class Router:
    scale: torch.Tensor  # [hidden]: applied after the norm, with 1 / sqrt(hidden)
    proj: torch.Tensor  # [num_experts, hidden]
    per_expert_scale: torch.Tensor  # [num_experts]
    top_k: int
    eps: float

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, hidden]
        """(weights [n, top_k] fp32, expert index [n, top_k] int64) per token."""
        h = norm_no_scale(x, self.eps) * self.scale * (x.shape[-1] ** -0.5)
        probs = F.softmax(F.linear(h, self.proj), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


@dataclass
class Experts:
    gate_up: torch.Tensor  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor  # [num_experts, hidden, intermediate]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def grouped(
        self,
        h: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k] fp32
        index: torch.Tensor,  # [n, top_k] int64
    ) -> torch.Tensor:  # [n, hidden]
        """The reference: each expert over its tokens as one matmul (see the module docstring)."""
        top_k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = h[token_of]  # [n * top_k, hidden]
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            seg = rows[start:start + count]
            gate, up = F.linear(seg, self.gate_up[expert]).chunk(2, dim=-1)
            out[start:start + count] = F.linear(F.gelu(gate, approximate="tanh") * up, self.down[expert])
            start += count
        out *= weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(h).index_add_(0, token_of, out)


def load_moe(get: Callable[[str], torch.Tensor], prefix: str, spec: MoESpec, eps: float) -> tuple[Router, Experts]:
    """The router and experts of one layer from checkpoint tensors under `prefix` (`model.layers.{i}.`)."""
    router = Router(
        scale=get(prefix + "router.scale"),
        proj=get(prefix + "router.proj.weight"),
        per_expert_scale=get(prefix + "router.per_expert_scale"),
        top_k=spec.top_k,
        eps=eps,
    )
    experts = Experts(gate_up=get(prefix + "experts.gate_up_proj"), down=get(prefix + "experts.down_proj"))
    return router, experts
