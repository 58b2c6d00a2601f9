"""Exp(1) noise for the exponential race (a token drawn as argmax p / E), made from uniforms.

The sampler and the rejection sampler draw `vocab` exponentials a sampled row a step, each seeded row from
its own generator. torch's CPU `exponential_` costs ~19 ns an element (0.62 ms for a 32k vocabulary on a
Zen 4 core), `uniform_` under 3 ns (0.09 ms): at batch 16 the draws alone were 10 ms of a 60 ms decode step
(bench/engine.py --sample on the Gemma 4 MoE config). So every path draws uniforms u in [0, 1) and maps
them in place by inversion, E = -log(1 - u), in [0, inf): the same distribution, one vectorized op.

One function for every caller keeps a seeded request's stream the same whichever path consumes it (the
sampler, a row without drafts in the rejection sampler, a decode engine skipping prefill's draws).
"""

from __future__ import annotations

import torch

# the smallest E: an exact 0 (u = 0) would make p / 0 = inf win the argmax, or a masked token's 0 / 0 a NaN,
# which argmax treats as the max
MIN_EXP = torch.finfo(torch.float32).tiny


def exponential_(noise: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill `noise` (float32, any shape) with Exp(1) draws from `generator`, in place; returns it."""
    noise.uniform_(generator=generator)
    return noise.neg_().log1p_().neg_().clamp_(min=MIN_EXP)
