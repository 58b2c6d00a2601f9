"""`rejection_sample_ref`: greedy exactness, edge cases, seeded noise, and distribution preservation.

The statistical tests draw many independent rows in one batch and compare the
empirical distribution of emitted tokens with the target's by a chi-square
test at p = 0.001 (critical values from the chi-square table, no scipy). Seeds
are fixed, so a pass is deterministic; the same statistic is shown to reject a
sampler that misstates the draft distribution, so the test has teeth. (A
one-hot draft distribution is never a misstatement: verifying the drafted
token alone is valid whatever distribution proposed it, only less accepting.)
"""

from __future__ import annotations

import pytest
import torch

from shared.ops.race_noise import exponential_
from shared.ops.rejection_sampler import RejectionNoise, draw_rejection_noise, rejection_sample_ref

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_0001 = {4: 18.467, 5: 20.515, 25: 52.620, 30: 59.703}


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of counts against probabilities, over cells with p > 0."""
    keep = expected_probs > 0
    total = observed.sum()
    expected = expected_probs[keep].double() * total
    assert expected.min() >= 5, "too few samples for the chi-square approximation"
    stat = ((observed[keep].double() - expected) ** 2 / expected).sum().item()
    return stat, int(keep.sum().item()) - 1


def greedy_noise(num_seqs: int, max_k: int, vocab: int) -> RejectionNoise:
    return draw_rejection_noise([max_k] * num_seqs, [None] * num_seqs, [True] * num_seqs, vocab, "cpu")


def test_greedy_is_the_argmax_chain() -> None:
    """Accept while draft == argmax; then emit the argmax at the first mismatch, or the bonus argmax."""
    gen = torch.Generator().manual_seed(0)
    num_seqs, max_k, vocab = 40, 5, 16
    logits = torch.randn(num_seqs, max_k + 1, vocab, generator=gen) * 3
    argmax = logits.argmax(-1)
    num_draft = torch.randint(0, max_k + 1, (num_seqs,), generator=gen)
    drafts = argmax[:, :max_k].clone()
    # corrupt one position in about half of the rows
    corrupt_at = torch.randint(0, max_k, (num_seqs,), generator=gen)
    for i in range(0, num_seqs, 2):
        j = int(corrupt_at[i])
        drafts[i, j] = (drafts[i, j] + 1 + int(torch.randint(vocab - 1, (1,), generator=gen))) % vocab
    drafts[num_draft.unsqueeze(1) <= torch.arange(max_k)] = -1  # padding

    out = rejection_sample_ref(
        drafts,
        num_draft,
        logits,
        None,
        torch.ones(num_seqs, dtype=torch.bool),
        greedy_noise(num_seqs, max_k, vocab),
    )
    for i in range(num_seqs):
        n = int(num_draft[i])
        accepted = next((j for j in range(n) if drafts[i, j] != argmax[i, j]), n)
        expected = argmax[i, : accepted + 1].tolist() + [-1] * (max_k - accepted)
        assert out.token_ids[i].tolist() == expected, i
        assert int(out.num_accepted[i]) == accepted


def test_draft_probs_do_not_matter_for_greedy_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 8, generator=gen)
    drafts = logits[:, :3].argmax(-1)
    noise = greedy_noise(3, 3, 8)
    greedy = torch.ones(3, dtype=torch.bool)
    num_draft = torch.tensor([3, 2, 0])
    draft_probs = torch.softmax(torch.randn(3, 3, 8, generator=gen), -1)
    a = rejection_sample_ref(drafts, num_draft, logits, None, greedy, noise)
    b = rejection_sample_ref(drafts, num_draft, logits, draft_probs, greedy, noise)
    assert torch.equal(a.token_ids, b.token_ids)
    assert a.num_accepted.tolist() == [3, 2, 0]
    assert a.token_ids[2].tolist() == [int(logits[2, 0].argmax()), -1, -1, -1]


def test_sampled_edge_cases() -> None:
    """Equal distributions accept everything; zero-probability and out-of-vocab drafts never pass."""
    vocab, max_k = 8, 3
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(4, max_k + 1, vocab, generator=gen), -1)
    draft_probs = probs[:, :max_k].clone()
    probs[1, 0] = 0.0
    probs[1, 0, 5] = 1.0  # row 1: the target is certain of token 5 at position 0
    drafts = torch.tensor([[1, 2, 3], [4, 2, 3], [-1, 0, 0], [vocab, 0, 0]])
    noise = draw_rejection_noise([max_k] * 4, [None] * 4, [False] * 4, vocab, "cpu", gen)
    noise.uniform[:] = 0.999999  # acceptance must not depend on luck here
    out = rejection_sample_ref(
        drafts, torch.tensor([3, 3, 3, 3]), probs, draft_probs, torch.zeros(4, dtype=torch.bool), noise
    )
    assert out.num_accepted.tolist() == [3, 0, 0, 0]
    assert out.token_ids[0, :3].tolist() == [1, 2, 3] and 0 <= out.token_ids[0, 3] < vocab
    assert out.token_ids[1].tolist() == [5, -1, -1, -1]
    assert ((out.token_ids[2:, 0] >= 0) & (out.token_ids[2:, 0] < vocab)).all()


def test_seeded_rows_reproducible_across_batches() -> None:
    """A seeded row's noise and output depend on its seed only, not on its batch or row index."""
    vocab, max_k = 16, 3
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(max_k + 1, vocab, generator=gen), -1)
    draft = torch.multinomial(probs[:max_k], 1, generator=gen).T  # [1, max_k]
    outs = []
    for row, batch in ((0, 3), (2, 4)):
        gens: list[torch.Generator | None] = [None] * batch
        gens[row] = torch.Generator().manual_seed(7)
        greedy = [False] * batch
        greedy[(row + 1) % batch] = True
        noise = draw_rejection_noise(
            [max_k] * batch, gens, greedy, vocab, "cpu", torch.Generator().manual_seed(row)
        )
        out = rejection_sample_ref(
            draft.expand(batch, -1), torch.full((batch,), max_k), probs.expand(batch, -1, -1).contiguous(),
            probs[:max_k].expand(batch, -1, -1).contiguous(), torch.tensor(greedy), noise,
        )  # fmt: skip
        outs.append((noise.uniform[row], noise.exponential[row], out.token_ids[row]))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_seeded_draw_consumes_a_fixed_amount() -> None:
    """num_uniforms uniforms then vocab exponentials: the stream after the draw is predictable."""
    used, fresh = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    draw_rejection_noise([4, 2], [None, used], [False, False], 10, "cpu")
    torch.empty(2).uniform_(generator=fresh)
    exponential_(torch.empty(10), fresh)
    assert torch.equal(torch.rand(5, generator=used), torch.rand(5, generator=fresh))


def _two_step_setup(num_seqs: int, vocab: int, onehot: bool, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Target p0 (with a zero, as top-k leaves), p1 = P1[d0] depending on the first draft; drafts d0, d1."""
    p0 = torch.tensor([0.30, 0.05, 0.25, 0.0, 0.15, 0.25])
    q0 = torch.tensor([0.05, 0.40, 0.10, 0.20, 0.05, 0.20])
    big_p1 = torch.softmax(torch.randn(vocab, vocab, generator=gen), -1)  # [d0, token], all > 0
    big_q1 = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 2, -1)
    if onehot:
        # deterministic drafts (n-gram): every token, also the forbidden one, as the first draft
        d0 = torch.arange(num_seqs) % vocab
        d1 = (d0 * 5 + 1) % vocab
    else:
        d0 = torch.multinomial(q0, num_seqs, replacement=True, generator=gen)
        d1 = torch.multinomial(big_q1[d0], 1, generator=gen).squeeze(1)
    target = torch.stack([p0.expand(num_seqs, -1), big_p1[d0], torch.full((num_seqs, vocab), 1 / vocab)], 1)
    return {
        "p0": p0,
        "q0": q0,
        "big_p1": big_p1,
        "drafts": torch.stack([d0, d1], 1),
        "target": target.contiguous(),
        "draft_probs": torch.stack([q0.expand(num_seqs, -1), big_q1[d0]], 1).contiguous(),
    }


@pytest.mark.parametrize("onehot", [False, True], ids=["draft-probs", "onehot-ngram"])
def test_emitted_tokens_follow_the_target(onehot: bool) -> None:
    """First emitted token ~ p0; given the first draft d0 = x was accepted, the second ~ P1[x]."""
    vocab, num_seqs = 6, 60_000
    gen = torch.Generator().manual_seed(4)
    s = _two_step_setup(num_seqs, vocab, onehot, gen)
    noise = draw_rejection_noise([2] * num_seqs, [None] * num_seqs, [False] * num_seqs, vocab, "cpu", gen)
    draft_probs = None if onehot else s["draft_probs"]
    is_greedy = torch.zeros(num_seqs, dtype=torch.bool)
    out = rejection_sample_ref(
        s["drafts"], torch.full((num_seqs,), 2), s["target"], draft_probs, is_greedy, noise
    )

    first = out.token_ids[:, 0]
    assert not (first == 3).any(), "a token the target forbids was emitted"
    stat, df = chi_square(torch.bincount(first, minlength=vocab), s["p0"])
    assert stat < CHI2_CRIT_0001[df], (stat, df)

    # second position, conditioned on acceptance, per value of the accepted first token
    stat2, df2 = 0.0, 0
    accepted = out.num_accepted >= 1
    for x in range(vocab):
        rows = accepted & (s["drafts"][:, 0] == x)
        if rows.any():
            st, d = chi_square(torch.bincount(out.token_ids[rows, 1], minlength=vocab), s["big_p1"][x])
            stat2, df2 = stat2 + st, df2 + d
    assert df2 == 25  # 5 degrees of freedom for each first token but 3, which is never accepted
    assert stat2 < CHI2_CRIT_0001[df2], stat2

    if not onehot:
        # the same statistic catches a sampler told the wrong draft distribution (q = p: accept everything)
        lie = s["target"][:, :2].contiguous()
        wrong = rejection_sample_ref(
            s["drafts"], torch.full((num_seqs,), 2), s["target"], lie, is_greedy, noise
        )
        stat_wrong, _ = chi_square(torch.bincount(wrong.token_ids[:, 0], minlength=vocab), s["p0"])
        assert stat_wrong > 10 * CHI2_CRIT_0001[df], stat_wrong


def test_bonus_and_plain_rows_sample_the_target() -> None:
    """No drafts (n = 0) is plain sampling from p0: same distribution."""
    vocab, num_seqs = 6, 30_000
    gen = torch.Generator().manual_seed(5)
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.05, 0.0, 0.35])
    target = p0.expand(num_seqs, 2, -1).contiguous()
    noise = draw_rejection_noise([1] * num_seqs, [None] * num_seqs, [False] * num_seqs, vocab, "cpu", gen)
    out = rejection_sample_ref(
        torch.zeros(num_seqs, 1, dtype=torch.int64), torch.zeros(num_seqs, dtype=torch.int64), target, None,
        torch.zeros(num_seqs, dtype=torch.bool), noise,
    )  # fmt: skip
    assert (out.num_accepted == 0).all() and (out.token_ids[:, 1] == -1).all()
    stat, df = chi_square(torch.bincount(out.token_ids[:, 0], minlength=vocab), p0)
    assert stat < CHI2_CRIT_0001[df], (stat, df)


def test_row_without_drafts_matches_the_plain_sampler() -> None:
    """Same seed, same processed distribution: a draft-less row emits the token `Sampler` picks."""
    from shared.engine.request import SamplingParams
    from shared.engine.sampler import Sampler

    vocab, temperature = 32, 0.7
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=temperature)] * 8
    plain = Sampler()(logits, params, [torch.Generator().manual_seed(s) for s in range(8)]).token_ids
    gens: list[torch.Generator | None] = [torch.Generator().manual_seed(s) for s in range(8)]
    noise = draw_rejection_noise([0] * 8, gens, [False] * 8, vocab, "cpu")
    probs = torch.softmax(logits / temperature, -1).unsqueeze(1)  # [8, 1, vocab]
    out = rejection_sample_ref(
        torch.zeros(8, 0, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), probs, None,
        torch.zeros(8, dtype=torch.bool), noise,
    )  # fmt: skip
    assert torch.equal(out.token_ids[:, 0], plain)
