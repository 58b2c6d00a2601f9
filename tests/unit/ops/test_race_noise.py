"""The exponential race's noise: Exp(1) by inversion of uniforms, one stream's worth per call."""

from __future__ import annotations

import math

import torch

from shared.ops.race_noise import MIN_EXP, exponential_


def test_draws_are_exp1_and_positive() -> None:
    noise = exponential_(torch.empty(200_000), torch.Generator().manual_seed(0))
    assert (noise >= MIN_EXP).all() and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.03
    # the CDF 1 - e^-x at a few points, against the empirical one (Kolmogorov-Smirnov-sized tolerance)
    for x in (0.1, 0.5, 1.0, 2.0, 4.0):
        assert abs((noise <= x).float().mean().item() - (1 - math.exp(-x))) < 0.005, x


def test_a_call_consumes_one_uniform_an_element() -> None:
    """What a decode engine relies on when it skips the draws prefill made for a seeded request."""
    used, fresh = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    exponential_(torch.empty(4, 7), used)
    torch.empty(28).uniform_(generator=fresh)
    assert torch.equal(torch.rand(5, generator=used), torch.rand(5, generator=fresh))


def test_the_race_picks_tokens_in_proportion() -> None:
    """argmax p / E over many draws lands on each token at its probability, and never on a zero."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(1)
    picks = torch.argmax(p / exponential_(torch.empty(50_000, 4), gen), dim=-1)
    freq = torch.bincount(picks, minlength=4).float() / picks.numel()
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], p[:3], atol=0.01, rtol=0)
