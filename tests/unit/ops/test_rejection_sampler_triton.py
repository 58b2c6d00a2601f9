"""The Triton rejection sampler against `rejection_sample_ref`: identical tokens and counts.

Without CUDA, conftest switches Triton to its interpreter and the kernels run
on CPU tensors; shapes stay small because the interpreter is slow. The
`gpu`-marked test compiles the kernels and checks real vocabulary sizes.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from shared.ops.rejection_sampler import RejectionNoise, draw_rejection_noise, rejection_sample_ref

triton_rs = importlib.import_module("shared.ops.rejection_sampler_triton")
# triton is installed everywhere (a dependency): without CUDA, conftest turns its interpreter on
assert triton_rs.triton_available(), "triton does not run here (neither CUDA nor its interpreter)"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(
    num_draft: list[int], max_k: int, vocab: int, seed: int, device: str = DEVICE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, RejectionNoise]:
    """(drafts, num_draft, target_probs, draft_probs, is_greedy, noise) mixing every kind of row.

    Row i % 4: 0 greedy, drafts = the target's argmax except one wrong position;
    1 sampled, target == draft distribution (all accepted, bonus sampled); 2
    greedy, random drafts; 3 sampled, target close to the draft (partial
    acceptance). Rows 6 and 7 (when present) also get out-of-vocabulary drafts;
    padding is -1.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(num_draft)
    kind = torch.arange(num_seqs) % 4
    target = torch.softmax(torch.randn(num_seqs, max_k + 1, vocab, generator=gen), -1)
    draft_probs = torch.softmax(torch.randn(num_seqs, max_k, vocab, generator=gen), -1)
    target[kind == 1, :max_k] = draft_probs[kind == 1]
    target[kind == 3, :max_k] = 0.8 * draft_probs[kind == 3] + 0.2 * target[kind == 3, :max_k]
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(num_seqs, max_k)
    drafts[kind == 0] = target[kind == 0, :max_k].argmax(-1)
    if max_k > 2:
        drafts[kind == 0, 2] = (drafts[kind == 0, 2] + 1) % vocab
    if num_seqs > 7 and max_k > 1:
        drafts[6, 0] = -5
        drafts[7, 1] = vocab
    is_greedy = kind % 2 == 0
    lengths = torch.tensor(num_draft)
    drafts[lengths.unsqueeze(1) <= torch.arange(max_k)] = -1
    noise = draw_rejection_noise([max_k] * num_seqs, [None] * num_seqs, is_greedy.tolist(), vocab, "cpu", gen)
    noise = RejectionNoise(uniform=noise.uniform.to(device), exponential=noise.exponential.to(device))
    tensors = (drafts, lengths.int(), target, draft_probs, is_greedy)
    return (*(t.to(device) for t in tensors), noise)  # type: ignore[return-value]


def assert_same(draft_probs_given: bool, case: tuple, **kwargs: int) -> None:  # type: ignore[type-arg]
    drafts, num_draft, target, draft_probs, is_greedy, noise = case
    dp = draft_probs if draft_probs_given else None
    ref = rejection_sample_ref(drafts, num_draft, target, dp, is_greedy, noise)
    out = triton_rs.rejection_sample_triton(drafts, num_draft, target, dp, is_greedy, noise, **kwargs)
    assert torch.equal(out.token_ids, ref.token_ids), (out.token_ids, ref.token_ids)
    assert torch.equal(out.num_accepted, ref.num_accepted)


@pytest.mark.parametrize("draft_probs_given", [True, False], ids=["draft-probs", "onehot"])
@pytest.mark.parametrize(("vocab", "block_v"), [(64, None), (50, 16)], ids=["v64-one-tile", "v50-four-tiles"])
def test_matches_reference(draft_probs_given: bool, vocab: int, block_v: int | None) -> None:
    case = make_case([0, 3, 4, 4, 4, 4, 4, 2, 4, 0], max_k=4, vocab=vocab, seed=vocab)
    if not draft_probs_given:
        # one-hot drafts: make rows 1 and 5 likely to accept them
        drafts, target = case[0], case[2]
        for i in (1, 5):
            onehot = torch.nn.functional.one_hot(drafts[i].clamp_min(0), vocab).float()
            target[i, :4] = 0.1 * target[i, :4] + 0.9 * onehot
    assert_same(draft_probs_given, case, **({"block_v": block_v} if block_v else {}))


def test_all_rejected_residual_fallback_and_zero_width() -> None:
    # equal target and draft make the residual all zero; force a rejection with u just below 1 anyway
    drafts, num_draft, target, draft_probs, is_greedy, noise = make_case([2, 2], 2, 16, seed=9)
    target[:, :2] = draft_probs
    drafts[:, 0] = 3
    target[:, 0, 3] = 0.0
    draft_probs[:, 0] = target[:, 0]
    assert_same(True, (drafts, num_draft, target, draft_probs, is_greedy, noise))
    # max_k = 0: every row is plain decoding
    case = make_case([0, 0, 0], 0, 16, seed=10)
    assert_same(False, case)


def test_rejects_bad_inputs() -> None:
    drafts, num_draft, target, draft_probs, is_greedy, noise = make_case([1, 2], 2, 16, seed=11)
    with pytest.raises(AssertionError, match="contiguous"):
        bad = target.transpose(1, 2).contiguous().transpose(1, 2)
        triton_rs.rejection_sample_triton(drafts, num_draft, bad, draft_probs, is_greedy, noise)
    with pytest.raises(AssertionError, match="int64"):
        triton_rs.rejection_sample_triton(drafts.int(), num_draft, target, draft_probs, is_greedy, noise)
    with pytest.raises(AssertionError, match="float32"):
        triton_rs.rejection_sample_triton(drafts, num_draft, target.half(), draft_probs, is_greedy, noise)
    with pytest.raises(AssertionError, match="target_probs"):
        triton_rs.rejection_sample_triton(drafts, num_draft, target[:, :2], draft_probs, is_greedy, noise)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [49_152, 262_144])
@pytest.mark.parametrize("draft_probs_given", [True, False], ids=["draft-probs", "onehot"])
def test_matches_reference_on_gpu(vocab: int, draft_probs_given: bool) -> None:
    """Compiled kernels, real vocabulary sizes, a decode-sized batch."""
    gen = torch.Generator().manual_seed(12)
    num_draft = torch.randint(0, 6, (64,), generator=gen).tolist()
    assert_same(draft_probs_given, make_case(num_draft, 5, vocab, seed=13, device="cuda"))
