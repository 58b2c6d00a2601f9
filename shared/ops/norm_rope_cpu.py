"""RMSNorm (alone or after the residual add) and RoPE as one C++ op each on the CPU
(`csrc/norm_rope_cpu.cpp`), for the decoder's forward.

Same contracts as `shared.models.common.rms_norm` / `apply_rope` (which stay the
reference, and what the trainable EAGLE head uses: these ops have no autograd).
Results agree with them to fp32 rounding. `BATON_CPU_FUSED_NORM_ROPE=0` turns
them off.
"""

from __future__ import annotations

import os

import torch

from shared.ops.cpu_kernels import cpu_kernels_available


def norm_rope_cpu_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and os.environ.get("BATON_CPU_FUSED_NORM_ROPE", "1") != "0" and cpu_kernels_available())


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` over the last dim (pass Gemma's 1 + w as the weight, as `rms_norm_offset` takes it)."""
    rows = x.reshape(-1, x.shape[-1])  # a view unless x's rows are not evenly spaced (q/k norm)
    return torch.ops.baton_cpu.rms_norm_rows(rows, weight, eps).view(x.shape)


def add_rms_norm_cpu(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm_cpu(x + delta)) for [rows, d] x and delta, in one pass; the same bits as the two
    apart (the decoder's residual add and the next norm)."""
    return torch.ops.baton_cpu.add_rms_norm_rows(x.contiguous(), delta.contiguous(), weight, eps)


def apply_rope_cpu_(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # from RotaryEmbedding.cos_sin: [num_tokens, 1, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin
    torch.ops.baton_cpu.rope_(q, k, cos.squeeze(1), sin.squeeze(1))
    return q, k
