"""Gemma 4's mixture-of-experts block: a router and a bank of gelu-tanh experts.

In every MoE layer the block runs beside the dense MLP (text.py adds the two)::

    router(x):   p = softmax(proj(rms(x) * scale / sqrt(hidden)))       fp32, over num_experts
                 w, e = top_k(p);  w = w / sum(w) * per_expert_scale[e]  [n, top_k] each
    experts(h):  out[t] = sum_j w[t, j] * down_e(gelu(gate_e(h[t])) * up_e(h[t]))   e = e[t, j]

The experts run grouped: the (token, expert) pairs are sorted by expert once,
and each expert that got tokens multiplies all of them at once over a
contiguous slice, never a loop over tokens; the weighted rows are summed back
per token in expert order, as transformers' loop adds them. Where:

    CPU, kernels built   PackedExperts (moe_cpu.py): one C++ op a layer over per-expert GEMV packs
    CUDA, triton         TritonExperts: two fused grouped-GEMM launches (shared/ops/fused_moe_triton.py)
    otherwise            TorchExperts: a Python loop over the experts hit, one F.linear pair each
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from shared.models.gemma4.moe_cpu import (
    EXPERT_QUANTIZATIONS,
    PackedExperts,
    packed_experts_available,
    quantized_experts_fit,
)
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


class Experts(Protocol):
    """A layer's routed experts: each token's top-k experts' outputs, weighted and summed."""

    @property
    def num_experts(self) -> int: ...

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's two projections as stored (what a pass over it reads)."""
        ...

    def __call__(
        self,
        h: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k] fp32
        index: torch.Tensor,  # [n, top_k] int64
    ) -> torch.Tensor: ...  # [n, hidden]


@dataclass
class TorchExperts:
    """The reference (and the path where no kernel serves): each expert over its tokens as one F.linear."""

    gate_up: torch.Tensor  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor  # [num_experts, hidden, intermediate]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def expert_nbytes(self) -> int:
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()

    def __call__(
        self,
        h: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k] fp32
        index: torch.Tensor,  # [n, top_k] int64
    ) -> torch.Tensor:  # [n, hidden]
        top_k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = h[token_of].to(self.gate_up.dtype)  # [n * top_k, hidden], in the weights' dtype
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
        return torch.zeros_like(h).index_add_(0, token_of, out.to(h.dtype))


class TritonExperts(TorchExperts):
    """The CUDA path: the fused grouped-GEMM kernels (shared/ops/fused_moe_triton.py) over the weights as given."""

    def __call__(
        self,
        h: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, top_k] fp32
        index: torch.Tensor,  # [n, top_k] int64
    ) -> torch.Tensor:  # [n, hidden]
        from shared.ops.fused_moe_triton import fused_moe_triton

        return fused_moe_triton(h.contiguous(), weights, index, self.gate_up, self.down)


def _triton_runs_here() -> bool:
    try:
        from shared.ops.triton_attention import triton_available
    except ImportError:  # no triton in this install
        return False
    return triton_available()


def make_experts(gate_up: torch.Tensor, down: torch.Tensor, quantization: str = "none") -> Experts:
    """The fastest experts for where the weights live: on the CPU the GEMV kernels over per-expert packs
    (fp32 or bf16, as the weights come; int8 or 4-bit blocks when `quantization` asks and the widths fit:
    otherwise they stay in the weights' dtype, as the narrow projections do), on CUDA the fused
    Triton kernels; torch's loop where neither serves.
    gate_up [num_experts, 2 * intermediate, hidden], down [num_experts, hidden, intermediate]."""
    if gate_up.device.type == "cpu" and packed_experts_available(gate_up.dtype):
        quantized = quantization in EXPERT_QUANTIZATIONS and quantized_experts_fit(gate_up, down)
        return PackedExperts(gate_up, down, quantization if quantized else "none")
    if gate_up.device.type == "cuda" and _triton_runs_here():
        return TritonExperts(gate_up.contiguous(), down.contiguous())
    return TorchExperts(gate_up, down)


def load_moe(get: Callable[[str], torch.Tensor], prefix: str, spec: MoESpec, eps: float,
             get_experts: Callable[[str], torch.Tensor] | None = None,
             quantization: str = "none") -> tuple[Router, Experts]:
    """The router and experts of one layer from checkpoint tensors under `prefix` (`model.layers.{i}.`);
    `get_experts` reads the expert banks (in the dtype they are stored in), `get` the rest; `quantization`:
    `--quantization`, which the experts take where the CPU kernels serve them (int8, q4_1)."""
    get_experts = get_experts or get
    router = Router(
        scale=get(prefix + "router.scale"),
        proj=get(prefix + "router.proj.weight"),
        per_expert_scale=get(prefix + "router.per_expert_scale"),
        top_k=spec.top_k,
        eps=eps,
    )
    experts = make_experts(get_experts(prefix + "experts.gate_up_proj"), get_experts(prefix + "experts.down_proj"),
                           quantization)
    return router, experts
