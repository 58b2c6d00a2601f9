"""silu(gate) * up as one C++ op on the CPU (`csrc/silu_mul_cpu.cpp`), for the Llama-family MLP.

It computes torch's silu the way torch's CPU kernel does (same SLEEF exp, same
formula, same tail handling), so it must give exactly `F.silu(gate) * up`: that
is checked once per process on a probe, and where it does not hold (another
torch, another CPU) the decoder keeps torch's two ops. `BATON_CPU_FUSED_SILU_MUL=0`
turns it off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from shared.ops.cpu_kernels import cpu_kernels_available

logger = logging.getLogger(__name__)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 * I] -> [n, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 * I] -> [n, I]
    return torch.ops.baton_cpu.silu_mul(gate_up)  # type: ignore[no-any-return]


def silu_mul_cpu_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and os.environ.get("BATON_CPU_FUSED_SILU_MUL", "1") != "0" and _gives_torchs_bits())


@functools.cache
def _gives_torchs_bits() -> bool:
    if not cpu_kernels_available():
        return False
    g = torch.Generator().manual_seed(0)
    # a width with a tail past the vector chunks, values wide enough to reach exp's every range
    probe = torch.randn(5, 2 * 1541, generator=g) * 8
    if torch.equal(silu_mul_cpu(probe), silu_mul_ref(probe)):
        return True
    logger.warning("fused silu*mul differs from torch's bits on this machine: using torch's ops")
    return False
