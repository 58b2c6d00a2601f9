"""Propose + verify in a loop reproduces plain greedy decoding token for token.

The target is a toy model whose next-token logits depend on the last two
tokens; a sampled row shares every batch, so greedy rows are shown to be exact
in mixed batches too.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from shared.ops.rejection_sampler import draw_rejection_noise, rejection_sample_ref
from shared.spec.ngram import NgramProposer
from shared.spec.proposer import ProposalInput, Proposer

VOCAB = 24
_gen = torch.Generator().manual_seed(0)
W_LAST = torch.randn(VOCAB, VOCAB, generator=_gen) * 3
W_PREV = torch.randn(VOCAB, VOCAB, generator=_gen) * 3


def target_logits(context: Sequence[int]) -> torch.Tensor:  # [VOCAB]
    return W_LAST[context[-1]] + W_PREV[context[-2]]


def greedy_chain(prompt: list[int], num_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(int(target_logits(seq).argmax()))
    return seq[len(prompt) :]


class NoisyOracle:
    """Proposes the true greedy continuation with one wrong token half of the time."""

    def __init__(self, chains: dict[str, list[int]], prompt_lens: dict[str, int]) -> None:
        self.chains, self.prompt_lens = chains, prompt_lens
        self.rng = torch.Generator().manual_seed(1)

    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        out = []
        for r in requests:
            done = len(r.token_ids) - self.prompt_lens[r.request_id]
            draft = list(self.chains[r.request_id][done : done + r.num_speculative_tokens])
            if draft and torch.rand(1, generator=self.rng) < 0.5:
                j = int(torch.randint(len(draft), (1,), generator=self.rng))
                draft[j] = (draft[j] + 1) % VOCAB
            out.append(draft)
        return out


def spec_decode(
    prompts: list[list[int]], proposer: Proposer, num_tokens: int, k: int, sampled_row: int
) -> tuple[list[list[int]], int]:
    """(outputs, number of verification steps) with rows greedy except `sampled_row`."""
    seqs = [list(p) for p in prompts]
    num_seqs, steps = len(prompts), 0
    is_greedy = torch.tensor([i != sampled_row for i in range(num_seqs)])
    while any(len(s) - len(p) < num_tokens for s, p in zip(seqs, prompts, strict=True)):
        drafts = proposer.propose([ProposalInput(str(i), s, k) for i, s in enumerate(seqs)])
        max_k = max(len(d) for d in drafts)
        draft_ids = torch.full((num_seqs, max_k), -1, dtype=torch.int64)
        target = torch.empty(num_seqs, max_k + 1, VOCAB)
        for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            draft_ids[i, : len(draft)] = torch.tensor(draft, dtype=torch.int64)
            for j in range(len(draft) + 1):
                target[i, j] = target_logits(seq + draft[:j])
        # greedy rows take raw logits (only their argmax is read); the sampled row takes probabilities
        target[sampled_row] = torch.softmax(target[sampled_row], -1)
        noise = draw_rejection_noise([k] * num_seqs, [None] * num_seqs, is_greedy.tolist(), VOCAB, "cpu")
        num_draft = torch.tensor([len(d) for d in drafts])
        out = rejection_sample_ref(draft_ids, num_draft, target, None, is_greedy, noise)
        for i, n in enumerate((out.num_accepted + 1).tolist()):
            seqs[i] += out.token_ids[i, :n].tolist()
        steps += 1
    return [s[len(p) : len(p) + num_tokens] for s, p in zip(seqs, prompts, strict=True)], steps


@pytest.mark.parametrize("method", ["ngram", "oracle"])
def test_speculative_greedy_equals_plain_greedy(method: str) -> None:
    prompts = [[1, 2, 3, 1, 2], [5, 7], [9, 9, 4, 9, 9, 4, 9], [0, 11, 3], [6, 6]]
    num_tokens = 40
    chains = {str(i): greedy_chain(p, num_tokens + 8) for i, p in enumerate(prompts)}
    proposer: Proposer = (
        NgramProposer(1, 3)
        if method == "ngram"
        else NoisyOracle(chains, {str(i): len(p) for i, p in enumerate(prompts)})
    )
    outputs, steps = spec_decode(prompts, proposer, num_tokens, k=4, sampled_row=3)
    for i, out in enumerate(outputs):
        if i != 3:
            assert out == chains[str(i)][:num_tokens], i
    assert all(0 <= t < VOCAB for t in outputs[3])
    assert steps < num_tokens  # speculation got tokens accepted
