"""verify_drafts: the engine's bridge from target logits to the rejection sampler.

Sampled rows go through temperature and top-k exactly as plain sampling does,
so emitted tokens follow the processed target distribution (chi-square on a
6-token vocabulary); suppression applies only to positions below min_tokens;
greedy rows are the argmax chain.
"""

from __future__ import annotations

import torch

from shared.engine.request import SamplingParams
from shared.engine.sampler import Sampler, processed_probs
from shared.spec.verify import VerifyInput, verify_drafts
from tests.unit.ops.test_rejection_sampler import chi_square

VOCAB = 6
LOGITS = torch.tensor([[2.0, 1.5, 0.2, -1.0, 0.7, -3.0],   # position 0: scores d_0
                       [0.1, 1.2, 2.2, 0.0, -0.5, 1.0]])  # position 1: scores d_1 / bonus


def run(params: SamplingParams, drafts: list[int], num_seqs: int, suppress: frozenset[int] = frozenset(),
        num_suppressed: int = 0) -> list[list[int]]:
    inputs = [VerifyInput(drafts, params, None, suppress, num_suppressed)] * num_seqs
    logits = LOGITS[: len(drafts) + 1].repeat(num_seqs, 1)
    return verify_drafts(logits, inputs, Sampler(seed=7)).emitted()


def test_sampled_tokens_follow_the_processed_target() -> None:
    params = SamplingParams(temperature=0.8, top_k=4)
    p = processed_probs(LOGITS, [params, params])  # [2, vocab], two tokens cut by top-k
    emitted = run(params, [1], num_seqs=40_000)
    first = torch.tensor([e[0] for e in emitted])
    stat, df = chi_square(torch.bincount(first, minlength=VOCAB), p[0])
    assert df == 3 and stat < 16.266, stat  # chi-square critical value for p = 0.001, 3 dof
    accepted = torch.tensor([len(e) == 2 for e in emitted])
    second = torch.tensor([e[1] for e in emitted if len(e) == 2])
    stat2, df2 = chi_square(torch.bincount(second, minlength=VOCAB), p[1])
    assert df2 == 3 and stat2 < 16.266, stat2
    # d_0 = 1 is accepted with probability p0(1)
    assert abs(accepted.float().mean().item() - p[0, 1].item()) < 0.01


def test_suppression_applies_below_min_tokens_only() -> None:
    params = SamplingParams(temperature=1.0)
    emitted = run(params, [0], num_seqs=4000, suppress=frozenset({0, 2}), num_suppressed=1)
    assert all(e[0] not in (0, 2) for e in emitted)  # suppressed draft never accepted, never sampled
    bonus_free = run(params, [1], num_seqs=4000, suppress=frozenset({2}), num_suppressed=1)
    assert any(len(e) == 2 and e[1] == 2 for e in bonus_free)  # position 1 is past min_tokens


def test_greedy_rows_take_the_argmax_chain_and_logprobs() -> None:
    params = SamplingParams(temperature=0.0, logprobs=2)
    inputs = [VerifyInput([0], params, None, frozenset(), 0), VerifyInput([3], params, None, frozenset(), 0)]
    logits = torch.cat([LOGITS, LOGITS])
    out = verify_drafts(logits, inputs, Sampler())
    emitted, logprobs = out.emitted(), out.logprobs
    assert out.token_ids.tolist() == [[0, 2], [0, -1]]  # -1 past what a chunk emits
    assert emitted == [[0, 2], [0]]  # accepted + bonus; rejected -> recovered argmax
    lp = torch.log_softmax(LOGITS, dim=-1)
    assert [x.token_id for x in logprobs[0]] == [0, 2]
    torch.testing.assert_close(logprobs[0][1].logprob, lp[1, 2].item())
    assert [t for t, _ in logprobs[1][0].top] == [0, 1]


def test_greedy_fast_path_matches_the_rejection_sampler() -> None:
    from shared.ops.rejection_sampler import draw_rejection_noise, rejection_sample_ref

    gen = torch.Generator().manual_seed(0)
    num_seqs, k, vocab = 64, 4, 5
    logits = torch.randn(num_seqs * (k + 1), vocab, generator=gen)
    drafts = torch.randint(0, vocab, (num_seqs, k), generator=gen)
    drafts[::2] = logits.view(num_seqs, k + 1, vocab)[::2, :k].argmax(-1)  # half the rows all-correct drafts
    params = SamplingParams(temperature=0.0)
    inputs = [VerifyInput(d.tolist(), params, None, frozenset(), 0) for d in drafts]
    fast = verify_drafts(logits, inputs, Sampler()).emitted()
    noise = draw_rejection_noise([k] * num_seqs, [None] * num_seqs, [True] * num_seqs, vocab, "cpu")
    ref = rejection_sample_ref(drafts, torch.full((num_seqs,), k), logits.view(num_seqs, k + 1, vocab), None,
                               torch.ones(num_seqs, dtype=torch.bool), noise)
    expected = [row[: n + 1] for row, n in zip(ref.token_ids.tolist(), ref.num_accepted.tolist(), strict=True)]
    assert fast == expected
    assert sum(len(e) == k + 1 for e in fast) >= num_seqs // 2
