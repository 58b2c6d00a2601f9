"""Speculative verification by rejection sampling: the torch reference.

One call verifies a whole batch. Row i proposed `num_draft_tokens[i] = n`
draft tokens d_0 .. d_{n-1} (the row is padded to `max_k`); the target ran
them and produced n + 1 next-token distributions p_0 .. p_n (p_j scores the
token after d_{j-1}; p_0 the token after the last known one). The terms follow
vLLM's rejection sampler (https://arxiv.org/abs/2211.17192):

- accepted tokens: the longest prefix of the drafts that passes the test.
  Greedy rows accept d_j while d_j == argmax(p_j). Sampled rows accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)), q_j being the draft's distribution
  (one-hot on d_j for deterministic drafts such as n-gram: pass
  `draft_probs=None`); a token the target gives probability 0 is never accepted.
- recovered token: at the first rejected position j, the token emitted instead:
  argmax(p_j) for greedy rows, a sample of normalize(max(0, p_j - q_j)) for
  sampled rows (of p_j itself if that residual is all zero, which only float
  rounding can produce).
- bonus token: when all n drafts are accepted, one more token from the last
  position: argmax(p_n) for greedy rows, a sample of p_n for sampled rows.

Output row layout (-1 past the emitted tokens)::

    n = 4, 2 accepted:  [ d_0, d_1, r_2, -1, -1 | ... -1 ]   r = recovered
    n = 4, 4 accepted:  [ d_0, d_1, d_2, d_3, b_4 | ... ]    b = bonus
    n = 0:              [ b_0, -1, ... ]                    plain decoding

`num_accepted[i]` counts the accepted drafts; the row emits num_accepted + 1.
For sampled rows each emitted token is distributed exactly as the target's
(tested statistically); greedy rows reproduce plain greedy decoding.

Inputs the caller prepares:

- `target_probs` are *processed* probabilities: temperature, top-k and top-p
  already applied and softmaxed, exactly the distribution plain sampling would
  draw from. Greedy rows only have their argmax read, so any monotone image of
  the logits works there; pass the logits themselves to match plain greedy
  decoding bit for bit (softmax rounding can tie two nearly equal logits).
- randomness comes in as tensors (`RejectionNoise`) drawn from each request's
  own generator (`draw_rejection_noise`), so seeded requests are reproducible
  whatever else shares the batch, and the op itself is deterministic.
  Sampling uses the exponential race (as `shared.engine.sampler` does):
  argmax(w / e) with e ~ Exp(1) i.i.d. per vocab entry is distributed as
  normalize(w). A row emits exactly one recovered-or-bonus token, so one noise
  vector per row serves every position.

`rejection_sampler_triton.py` is the GPU twin of `rejection_sample_ref`; both
compute bit-identical results on the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.ops.host_copy import to_device
from shared.ops.race_noise import exponential_

__all__ = ["RejectionNoise", "RejectionOutput", "draw_rejection_noise", "rejection_sample_ref"]


@dataclass
class RejectionNoise:
    """The random numbers one verification consumes."""

    uniform: torch.Tensor  # [num_seqs, >= max_k] float32 in [0, 1): acceptance tests
    exponential: torch.Tensor  # [num_seqs, vocab] float32 Exp(1) > 0: recovered / bonus draws


@dataclass
class RejectionOutput:
    token_ids: torch.Tensor  # [num_seqs, max_k + 1] int64: accepted drafts, then recovered/bonus, then -1
    num_accepted: torch.Tensor  # [num_seqs] int64: accepted drafts per row (row emits this + 1)


def draw_rejection_noise(
    num_uniforms: Sequence[int],
    generators: Sequence[torch.Generator | None],
    is_greedy: Sequence[bool],
    vocab_size: int,
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> RejectionNoise:
    """Draw each sampled row's noise from its own generator; greedy rows draw nothing.

    Args:
        num_uniforms: per row, how many acceptance uniforms to draw. Pass the
            request's configured number of speculative tokens (not what the
            proposer returned this step) so a seeded stream advances by the same
            amount every step; the width of `uniform` is the largest of these.
        generators: per row, the request's generator; None draws from
            `default_generator` (torch's global one if that is None too).
        is_greedy: per row; greedy rows get zeros/ones that are never read.

    A seeded row consumes `num_uniforms[i]` uniforms, then `vocab_size` exponentials.
    With `num_uniforms[i] == 0` that is exactly what one step of `Sampler` consumes,
    and a row without drafts then emits the token `Sampler` would (same race, same noise).
    """
    num_seqs = len(num_uniforms)
    if len(generators) != num_seqs or len(is_greedy) != num_seqs:
        raise ValueError(f"expected {num_seqs} generators and is_greedy flags")
    width = max(num_uniforms, default=0)
    uniform = torch.zeros(num_seqs, width, dtype=torch.float32, device=device)
    exponential = torch.ones(num_seqs, vocab_size, dtype=torch.float32, device=device)
    shared_rows = [i for i in range(num_seqs) if not is_greedy[i] and generators[i] is None]
    if shared_rows:
        # unseeded rows share one stream, so one draw covers them all
        index = to_device(shared_rows, device=device)
        num_shared = len(shared_rows)
        uniform[index] = torch.empty(num_shared, width, device=device).uniform_(generator=default_generator)
        exponential[index] = exponential_(torch.empty(num_shared, vocab_size, device=device), default_generator)
    for i, generator in enumerate(generators):
        if generator is not None and not is_greedy[i]:
            uniform[i, : num_uniforms[i]].uniform_(generator=generator)
            exponential_(exponential[i], generator)
    return RejectionNoise(uniform=uniform, exponential=exponential)


def _draft_token_probs(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k]
    probs: torch.Tensor,  # [num_seqs, >= max_k, vocab]
    in_vocab: torch.Tensor,  # [num_seqs, max_k] bool
    fill: float,
) -> torch.Tensor:  # [num_seqs, max_k]: probs[i, j, d_ij], `fill` where d_ij is out of range
    max_k = draft_token_ids.shape[1]
    safe_ids = torch.where(in_vocab, draft_token_ids, 0)
    picked = probs[:, :max_k].gather(2, safe_ids.unsqueeze(2)).squeeze(2)
    return torch.where(in_vocab, picked, fill)


def _candidates(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k] int64
    is_draft: torch.Tensor,  # [num_seqs, max_k] bool: position < num_draft_tokens
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab]
    draft_probs: torch.Tensor | None,  # [num_seqs, max_k, vocab]
    is_greedy: torch.Tensor,  # [num_seqs] bool
    exponential: torch.Tensor,  # [num_seqs, vocab]
) -> torch.Tensor:  # [num_seqs, max_k + 1] int64
    """The token each position would emit if it were the first rejection (or the bonus position)."""
    vocab = target_probs.shape[2]
    target = target_probs[:, :-1]  # [num_seqs, max_k, vocab]
    if draft_probs is None:
        # one-hot drafts; an out-of-range draft subtracts nothing
        q = torch.zeros_like(target)
        in_vocab = (draft_token_ids >= 0) & (draft_token_ids < vocab)
        q.scatter_(2, torch.where(in_vocab, draft_token_ids, 0).unsqueeze(2), in_vocab.unsqueeze(2).float())
    else:
        q = draft_probs
    residual = (target - q).clamp_min(0.0)
    use_residual = is_draft & ~is_greedy.unsqueeze(1) & (residual.amax(dim=2) > 0)
    dist = target_probs.clone()
    dist[:, :-1] = torch.where(use_residual.unsqueeze(2), residual, target)
    sampled = dist / exponential.unsqueeze(1)
    scores = torch.where(is_greedy.view(-1, 1, 1), target_probs, sampled)
    return scores.argmax(dim=2)


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k] int64, padded past num_draft_tokens
    num_draft_tokens: torch.Tensor,  # [num_seqs] int32/int64, each in [0, max_k]
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab] float32, processed (see module doc)
    draft_probs: torch.Tensor | None,  # [num_seqs, max_k, vocab] float32; None = one-hot drafts
    is_greedy: torch.Tensor,  # [num_seqs] bool
    noise: RejectionNoise,
) -> RejectionOutput:
    """Verify every row's drafts at once; see the module docstring for the semantics.

    Draft ids outside [0, vocab) are rejected, never emitted. `num_draft_tokens`
    larger than max_k is read as max_k. Nothing here reads device values back to
    the host.
    """
    draft_token_ids = draft_token_ids.long()
    num_seqs, max_k = draft_token_ids.shape
    vocab = target_probs.shape[2]
    assert target_probs.shape == (num_seqs, max_k + 1, vocab), (target_probs.shape, draft_token_ids.shape)
    assert noise.uniform.shape[0] == num_seqs and noise.uniform.shape[1] >= max_k, noise.uniform.shape
    assert noise.exponential.shape == (num_seqs, vocab), noise.exponential.shape
    device = target_probs.device
    num_draft = num_draft_tokens.long().clamp(0, max_k)
    is_draft = torch.arange(max_k, device=device).unsqueeze(0) < num_draft.unsqueeze(1)  # [num_seqs, max_k]
    in_vocab = (draft_token_ids >= 0) & (draft_token_ids < vocab)

    candidates = _candidates(
        draft_token_ids, is_draft, target_probs, draft_probs, is_greedy, noise.exponential
    )  # [num_seqs, max_k + 1]
    p = _draft_token_probs(draft_token_ids, target_probs, in_vocab, 0.0)
    q = 1.0 if draft_probs is None else _draft_token_probs(draft_token_ids, draft_probs, in_vocab, 1.0)
    # u < p / q without the division: u * q < p (q = 0 < p accepts: min(1, p / 0) = 1)
    sampled_ok = noise.uniform[:, :max_k] * q < p
    greedy_ok = draft_token_ids == candidates[:, :-1]
    ok = torch.where(is_greedy.unsqueeze(1), greedy_ok, sampled_ok) & is_draft
    accepted = ok.long().cumprod(dim=1).bool()  # [num_seqs, max_k]: the accepted prefix
    num_accepted = accepted.sum(dim=1)  # [num_seqs]

    token_ids = torch.full((num_seqs, max_k + 1), -1, dtype=torch.int64, device=device)
    token_ids[:, :max_k] = torch.where(accepted, draft_token_ids, -1)
    last = num_accepted.unsqueeze(1)
    token_ids.scatter_(1, last, candidates.gather(1, last))
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)
