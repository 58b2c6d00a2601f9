"""Verification of draft tokens against the target's logits, for a batch of chunks.

A verification chunk ran `[t_{L-1}, d_0 .. d_{k-1}]` through the target, so
its last k + 1 rows of logits score the tokens at positions L .. L + k. This
module turns those rows into the processed distributions the rejection
sampler expects and returns, per chunk, the tokens it emits: the accepted
drafts, then the recovered or bonus token::

    logits rows (flat)  [c0: k0 + 1 rows][c1: k1 + 1 rows] ...
          │ suppress (eos/stop ids at positions still below min_tokens)
          ├ greedy rows:  the logits themselves (argmax is all that is read)
          └ sampled rows: temperature, top-k, top-p, softmax (as plain sampling)
    target [num_chunks, max_k + 1, vocab] ──► rejection sampler ──► emitted ids

A batch of greedy rows only needs argmaxes and skips the sampler.
Drafts are taken as deterministic (one-hot q): every proposer here proposes
greedily, which keeps the output distribution exactly the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.request import SamplingParams, TokenLogprobs
from shared.engine.sampler import Sampler, processed_probs, raw_logprobs, suppress
from shared.ops.rejection_sampler import (
    RejectionNoise,
    RejectionOutput,
    draw_rejection_noise,
    rejection_sample_ref,
)

__all__ = ["VerifyInput", "verify_drafts"]


@dataclass(frozen=True)
class VerifyInput:
    """One chunk to verify: its drafts and how its tokens are picked."""

    draft_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    suppress_token_ids: frozenset[int]
    num_suppressed_positions: int  # suppress_token_ids applies to positions 0 .. this - 1


def verify_drafts(
    logits: torch.Tensor,  # [sum(len(drafts) + 1), vocab] float32, chunk after chunk
    inputs: Sequence[VerifyInput],
    sampler: Sampler,
) -> tuple[list[list[int]], list[list[TokenLogprobs]]]:
    """Per chunk: the emitted token ids (num_accepted + 1 of them) and their logprobs ([] when off)."""
    sizes = [len(v.draft_token_ids) + 1 for v in inputs]
    num_rows, vocab = logits.shape
    assert num_rows == sum(sizes), (num_rows, sizes)
    device = logits.device
    num_seqs, max_k = len(inputs), max(sizes) - 1
    row_suppress = [
        v.suppress_token_ids if j < v.num_suppressed_positions else frozenset()
        for v, size in zip(inputs, sizes, strict=True) for j in range(size)
    ]
    masked = suppress(logits, row_suppress)  # [num_rows, vocab]
    if all(v.params.is_greedy for v in inputs):
        emitted = _greedy_chains(masked.argmax(dim=-1).tolist(), inputs, sizes)
        return emitted, _logprobs(logits, inputs, sizes, emitted)
    row_params = [v.params for v, size in zip(inputs, sizes, strict=True) for _ in range(size)]
    sampled_rows = [r for r, p in enumerate(row_params) if not p.is_greedy]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=device)
        masked = masked.index_copy(0, index, processed_probs(masked.index_select(0, index),
                                                             [row_params[r] for r in sampled_rows]))
    seq_of_row = torch.tensor([i for i, size in enumerate(sizes) for _ in range(size)], device=device)
    pos_of_row = torch.tensor([j for size in sizes for j in range(size)], device=device)
    target = torch.zeros(num_seqs, max_k + 1, vocab, dtype=torch.float32, device=device)
    target[seq_of_row, pos_of_row] = masked

    draft_ids = torch.zeros(num_seqs, max(max_k, 1), dtype=torch.int64)
    for i, v in enumerate(inputs):
        draft_ids[i, : len(v.draft_token_ids)] = torch.tensor(v.draft_token_ids, dtype=torch.int64)
    draft_ids = draft_ids[:, :max_k].to(device)
    num_draft = torch.tensor([size - 1 for size in sizes], dtype=torch.int64, device=device)
    is_greedy_host = [v.params.is_greedy for v in inputs]
    noise = draw_rejection_noise(
        [size - 1 for size in sizes], [v.generator for v in inputs], is_greedy_host, vocab, device,
        default_generator=sampler.default_generator(device),
    )
    is_greedy = torch.tensor(is_greedy_host, dtype=torch.bool, device=device)
    out = _rejection_sample(draft_ids, num_draft, target, is_greedy, noise)
    token_rows = out.token_ids.tolist()
    num_accepted = out.num_accepted.tolist()
    emitted = [row[: n + 1] for row, n in zip(token_rows, num_accepted, strict=True)]
    return emitted, _logprobs(logits, inputs, sizes, emitted)


def _greedy_chains(argmax: list[int], inputs: Sequence[VerifyInput], sizes: list[int]) -> list[list[int]]:
    """All-greedy batches: accept drafts while they equal the argmax, then emit the argmax.

    What the rejection sampler computes for greedy rows, without its
    [num_seqs, max_k + 1, vocab] work.
    """
    emitted = []
    start = 0
    for v, size in zip(inputs, sizes, strict=True):
        best = argmax[start : start + size]
        n = 0
        while n < size - 1 and v.draft_token_ids[n] == best[n]:
            n += 1
        emitted.append(list(v.draft_token_ids[:n]) + [best[n]])
        start += size
    return emitted


def _rejection_sample(
    draft_ids: torch.Tensor,  # [num_seqs, max_k]
    num_draft: torch.Tensor,  # [num_seqs]
    target: torch.Tensor,  # [num_seqs, max_k + 1, vocab]
    is_greedy: torch.Tensor,  # [num_seqs]
    noise: RejectionNoise,
) -> RejectionOutput:
    """The Triton kernel on CUDA, the torch reference elsewhere (same results)."""
    if target.is_cuda:
        from shared.ops.rejection_sampler_triton import rejection_sample_triton, triton_available

        if triton_available():
            return rejection_sample_triton(draft_ids, num_draft, target, None, is_greedy, noise)
    return rejection_sample_ref(draft_ids, num_draft, target, None, is_greedy, noise)


def _logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] raw
    inputs: Sequence[VerifyInput],
    sizes: list[int],
    emitted: list[list[int]],
) -> list[list[TokenLogprobs]]:
    """Raw logprobs of each emitted token, from the row that scored it."""
    result: list[list[TokenLogprobs]] = [[] for _ in inputs]
    wanted = [i for i, v in enumerate(inputs) if v.params.logprobs is not None]
    if not wanted:
        return result
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    rows = [starts[i] + j for i in wanted for j in range(len(emitted[i]))]
    token_ids = torch.tensor([t for i in wanted for t in emitted[i]], device=logits.device)
    params = [inputs[i].params for i in wanted for _ in emitted[i]]
    flat = raw_logprobs(logits[torch.tensor(rows, device=logits.device)], token_ids, params)
    k = 0
    for i in wanted:
        for _ in emitted[i]:
            lp = flat[k]
            assert lp is not None
            result[i].append(lp)
            k += 1
    return result
