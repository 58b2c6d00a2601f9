"""Unit tests for shared.engine.sampler (CPU only)."""

from __future__ import annotations

import math

import pytest
import torch

from shared.engine.request import SamplingParams
from shared.engine.sampler import Sampler, SamplerOutput, make_generator

CPU = torch.device("cpu")

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def _random_logits(num_seqs: int, vocab: int, seed: int = 0) -> torch.Tensor:  # [num_seqs, vocab]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, vocab, generator=g) * 3.0


def _sample(
    logits: torch.Tensor,  # [num_seqs, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    sampler: Sampler | None = None,
    suppress: list[set[int]] | None = None,
) -> SamplerOutput:
    sampler = sampler if sampler is not None else Sampler(seed=0)
    gens = generators if generators is not None else [None] * len(params)
    return sampler(logits, params, gens, suppress)


def test_make_generator() -> None:
    assert make_generator(None, CPU) is None
    a, b = make_generator(7, CPU), make_generator(7, CPU)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_greedy_is_argmax_bit_identical_including_ties() -> None:
    g = torch.Generator().manual_seed(1)
    # small integer-valued logits force many ties within a row
    logits = torch.randint(-3, 4, (64, 50), generator=g).float()
    params = [SamplingParams(temperature=0.0)] * 64
    out = _sample(logits, params)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, torch.argmax(logits, -1))
    assert out.logprobs == [None] * 64

    tie = torch.tensor([[1.0, 5.0, 2.0, 5.0, 5.0]])
    assert _sample(tie, [SamplingParams(temperature=0.0)]).token_ids.tolist() == [1]


def test_greedy_rows_unaffected_by_sampled_rows_in_batch() -> None:
    logits = _random_logits(10, 200, seed=2)
    params = [
        SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.3, top_p=0.9)
        for i in range(10)
    ]
    out = _sample(logits, params)
    assert torch.equal(out.token_ids[0::2], torch.argmax(logits[0::2], -1))


def test_top_k_one_equals_greedy_with_temperature() -> None:
    logits = _random_logits(32, 300, seed=3)
    params = [SamplingParams(temperature=0.8, top_k=1)] * 32
    gens = [make_generator(i, CPU) for i in range(32)]
    out = _sample(logits, params, gens)
    assert torch.equal(out.token_ids, torch.argmax(logits, -1))


def test_tiny_top_p_gives_argmax() -> None:
    logits = _random_logits(32, 300, seed=4)
    params = [SamplingParams(temperature=1.5, top_p=1e-6)] * 32
    sampler = Sampler(seed=5)
    for _ in range(5):
        out = _sample(logits, params, sampler=sampler)
        assert torch.equal(out.token_ids, torch.argmax(logits, -1))


def _seeded_run(
    target_logits: torch.Tensor,  # [vocab]
    target_params: SamplingParams,
    batch_size: int,
    row: int,
    steps: int,
) -> list[int]:
    """Tokens the target row gets over `steps` calls when placed at `row` among random neighbours."""
    vocab = target_logits.shape[0]
    gen = make_generator(target_params.seed, CPU)
    neighbour_params = [
        SamplingParams(temperature=0.9, top_k=50),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_p=0.7, seed=99),
        SamplingParams(temperature=1.0),
    ]
    sampler = Sampler(seed=batch_size * 31 + row)
    tokens: list[int] = []
    for step in range(steps):
        logits = _random_logits(batch_size, vocab, seed=1000 + step + 17 * row)
        logits[row] = target_logits
        params = [neighbour_params[i % len(neighbour_params)] for i in range(batch_size)]
        params[row] = target_params
        gens = [make_generator(p.seed, CPU) for p in params]
        gens[row] = gen
        tokens.append(int(_sample(logits, params, gens, sampler=sampler).token_ids[row]))
    return tokens


def test_seeded_reproducible_across_calls_and_batch_positions() -> None:
    vocab = 500
    # flat-ish logits so a different random stream would almost surely pick different tokens
    target = _random_logits(1, vocab, seed=6)[0] * 0.2
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = _seeded_run(target, params, batch_size=1, row=0, steps=20)
    assert alone == _seeded_run(target, params, batch_size=1, row=0, steps=20)
    assert alone == _seeded_run(target, params, batch_size=6, row=3, steps=20)
    assert alone == _seeded_run(target, params, batch_size=9, row=8, steps=20)
    # the generator advances between steps rather than repeating one draw
    assert len(set(alone)) > 10


def test_different_seeds_differ() -> None:
    vocab = 100
    logits = torch.zeros(2, vocab)
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    gens = [make_generator(1, CPU), make_generator(2, CPU)]
    sampler = Sampler(seed=0)
    draws = torch.stack([_sample(logits, params, gens, sampler=sampler).token_ids for _ in range(50)])
    assert not torch.equal(draws[:, 0], draws[:, 1])


def test_unseeded_rows_vary_between_rows() -> None:
    out = _sample(torch.zeros(64, 1000), [SamplingParams()] * 64)
    assert len(set(out.token_ids.tolist())) > 32


def _expected_distribution(logits: list[float], params: SamplingParams) -> list[float]:
    """Reference: temperature, top-k, top-p, renormalise, in float64 with plain Python."""
    scaled = [x / params.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[: params.top_k] if params.top_k > 0 else order
    m = max(scaled[i] for i in keep)
    weights = {i: math.exp(scaled[i] - m) for i in keep}
    total = sum(weights.values())
    nucleus: list[int] = []
    mass = 0.0
    for i in keep:
        nucleus.append(i)
        mass += weights[i] / total
        if mass >= params.top_p:
            break
    z = sum(weights[i] for i in nucleus)
    return [weights[i] / z if i in nucleus else 0.0 for i in range(len(logits))]


def _chi_square(counts: list[int], expected: list[float], draws: int) -> tuple[float, int]:
    stat = sum((c - draws * p) ** 2 / (draws * p) for c, p in zip(counts, expected, strict=True) if p > 0)
    return stat, sum(p > 0 for p in expected) - 1


@pytest.mark.parametrize("seeded_rows", [False, True])
def test_distribution_matches_temperature_top_k_top_p(seeded_rows: bool) -> None:
    raw = [2.0, 1.5, 1.0, 0.4, -0.5, 0.9]
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.85)
    expected = _expected_distribution(raw, params)
    # sanity on the reference: top-k drops 2 ids, top-p drops one more, top_p is not near a boundary
    assert sum(p == 0.0 for p in expected) == 3
    assert expected[3] == expected[4] == expected[5] == 0.0

    draws = 20000
    logits = torch.tensor(raw).expand(draws, -1).contiguous()
    gens = [make_generator(10_000 + i, CPU) for i in range(draws)] if seeded_rows else None
    out = _sample(logits, [params] * draws, gens, sampler=Sampler(seed=123))
    counts = torch.bincount(out.token_ids, minlength=len(raw)).tolist()

    assert all(c == 0 for c, p in zip(counts, expected, strict=True) if p == 0.0), counts
    stat, dof = _chi_square(counts, expected, draws)
    assert stat < CHI2_CRIT_P001[dof], (stat, counts, expected)


def test_chi_square_detects_wrong_distribution() -> None:
    # guards the statistical test itself: a plain softmax sample must fail against the filtered reference
    raw = [2.0, 1.5, 1.0, 0.4, -0.5, 0.9]
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.85)
    expected = _expected_distribution(raw, params)
    draws = 20000
    out = _sample(torch.tensor(raw).expand(draws, -1).contiguous(), [SamplingParams(temperature=0.8)] * draws)
    counts = torch.bincount(out.token_ids, minlength=len(raw)).tolist()
    stat, dof = _chi_square(counts, expected, draws)
    assert stat > CHI2_CRIT_P001[dof]


def test_suppression_never_returns_suppressed_ids() -> None:
    vocab = 20
    logits = torch.zeros(400, vocab)
    logits[:, 3] = 8.0  # suppressed ids dominate the unsuppressed distribution
    logits[:, 7] = 8.0
    suppress = [{3, 7, 10_000}] * 400  # out-of-vocab ids are ignored
    params = [SamplingParams(temperature=1.0)] * 200 + [SamplingParams(temperature=2.0, top_k=3)] * 200
    sampler = Sampler(seed=8)
    for _ in range(5):
        tokens = _sample(logits, params, sampler=sampler, suppress=suppress).token_ids
        assert not torch.isin(tokens, torch.tensor([3, 7])).any()


def test_suppression_greedy_and_top_k_pick_next_best() -> None:
    logits = torch.tensor([[0.0, 5.0, 3.0, 4.0], [0.0, 5.0, 3.0, 4.0], [0.0, 5.0, 3.0, 4.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1), SamplingParams()]
    out = _sample(logits, params, suppress=[{1}, {1, 3}, set()])
    assert out.token_ids[:2].tolist() == [3, 2]


def test_logprobs_are_raw_and_top_sorted() -> None:
    logits = _random_logits(4, 64, seed=9)
    params = [
        SamplingParams(temperature=0.5, top_k=5, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    suppress = [set(), set(), set(), {int(torch.argmax(logits[3]))}]
    out = _sample(logits, params, suppress=suppress)
    raw = torch.log_softmax(logits, dim=-1)

    assert out.logprobs[2] is None
    for row, n in [(0, 3), (1, 0), (3, 5)]:
        lp = out.logprobs[row]
        assert lp is not None
        token = int(out.token_ids[row])
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(raw[row, token]), abs=1e-6)
        assert len(lp.top) == n
        want_values, want_ids = raw[row].topk(n)
        assert [i for i, _ in lp.top] == want_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want_values.tolist(), abs=1e-6)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
    # suppression changed the pick but the top list still reports the raw best token
    assert out.logprobs[3] is not None
    assert out.logprobs[3].top[0][0] == int(torch.argmax(logits[3]))
    assert out.logprobs[3].token_id != out.logprobs[3].top[0][0]


def test_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None, None])
