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

A batch of greedy rows only needs argmaxes and skips the sampler. Results
stay on the device (`VerifyOutput`): the zero-bubble loop builds the next
step's inputs from them without a copy to the host.
Drafts are taken as deterministic (one-hot q): every proposer here proposes
greedily, which keeps the output distribution exactly the target's.

Draft trees (shared/spec/tree.py) are verified greedily: a chunk's rows are its
tree's nodes, and acceptance follows the branch whose every node is the
target's argmax at its parent (`greedy_trees`). Only greedy requests draft
trees; a batch that also holds sampled chains verifies the two groups apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.request import SamplingParams, TokenLogprobs
from shared.engine.sampler import Sampler, processed_probs, raw_logprobs, suppress
from shared.ops.host_copy import to_device
from shared.ops.rejection_sampler import (
    RejectionNoise,
    RejectionOutput,
    draw_rejection_noise,
    rejection_sample_ref,
)
from shared.spec.tree import DraftTree

__all__ = ["VerifyInput", "VerifyOutput", "verify_drafts"]


@dataclass(frozen=True)
class VerifyInput:
    """One chunk to verify: its drafts and how its tokens are picked."""

    draft_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    suppress_token_ids: frozenset[int]
    num_suppressed_positions: int  # suppress_token_ids applies to positions 0 .. this - 1
    tree: DraftTree | None = None  # the drafts are this tree's nodes 1..n (greedy requests only); None: a chain

    @property
    def shape(self) -> DraftTree:
        return self.tree if self.tree is not None else DraftTree.chain(len(self.draft_token_ids))


@dataclass
class VerifyOutput:
    """Per chunk, what verification emits; the tensors stay where the logits were."""

    token_ids: torch.Tensor  # [num_chunks, max_k + 1] int64: accepted drafts, recovered/bonus, then -1
    num_accepted: torch.Tensor  # [num_chunks] int64
    logprobs: list[list[TokenLogprobs]] = field(default_factory=list)  # per chunk; [] when not asked
    # trees in the batch: [num_chunks, width] the chunk row (tree node) of each accepted position, root
    # first (past the accepted ones: any row); None: every chunk's accepted rows are its first num_accepted + 1
    branch: torch.Tensor | None = None

    def emitted(self) -> list[list[int]]:
        """The emitted ids per chunk, read to the host (num_accepted + 1 each)."""
        rows, counts = self.token_ids.tolist(), self.num_accepted.tolist()
        return [row[: n + 1] for row, n in zip(rows, counts, strict=True)]


def verify_drafts(
    logits: torch.Tensor,  # [sum(len(drafts) + 1), vocab] float32, chunk after chunk
    inputs: Sequence[VerifyInput],
    sampler: Sampler,
    num_suppressed: torch.Tensor | None = None,
    raw_logits: torch.Tensor | None = None,
) -> VerifyOutput:
    """Per chunk: the emitted token ids (num_accepted + 1 of them) and their logprobs when asked.

    `logits` have been through the logits pipeline (shared/engine/logits/); `raw_logits`, the model's
    own, are what logprobs report (None: `logits`). `num_suppressed` ([num_chunks] int64 on the device)
    overrides `num_suppressed_positions`, when only the device knows how many positions are still below
    min_tokens (the zero-bubble loop).
    """
    sizes = [len(v.draft_token_ids) + 1 for v in inputs]
    num_rows, vocab = logits.shape
    assert num_rows == sum(sizes), (num_rows, sizes)
    has_trees = any(v.tree is not None for v in inputs)
    raw = logits if raw_logits is None else raw_logits
    if has_trees and not all(v.params.is_greedy for v in inputs):
        return _verify_apart(logits, inputs, sizes, sampler, num_suppressed, raw)
    device = logits.device
    num_seqs, max_k = len(inputs), max(sizes) - 1
    seq_of_row = to_device([i for i, size in enumerate(sizes) for _ in range(size)], device=device)
    pos_of_row = to_device([j for size in sizes for j in range(size)], device=device)
    # the sampling position a row scores: its tree depth (a chain's rows are positions 0..k)
    depth_host = [d for v in inputs for d in v.shape.depths]
    row_suppress = [
        v.suppress_token_ids if num_suppressed is not None or d < v.num_suppressed_positions else frozenset()
        for v in inputs for d in v.shape.depths
    ]
    depth_of_row = to_device(depth_host, device=device) if has_trees else pos_of_row
    active = depth_of_row < num_suppressed[seq_of_row] if num_suppressed is not None else None
    masked = suppress(logits, row_suppress, active)  # [num_rows, vocab]
    padded = [list(v.draft_token_ids) + [-1] * (max_k + 1 - len(v.draft_token_ids)) for v in inputs]
    draft_ids = to_device(padded, dtype=torch.int64, device=device)
    num_draft = to_device([size - 1 for size in sizes], dtype=torch.int64, device=device)
    if all(v.params.is_greedy for v in inputs):
        best = torch.full((num_seqs, max_k + 1), -1, dtype=torch.int64, device=device)
        best[seq_of_row, pos_of_row] = masked.argmax(dim=-1)
        out = greedy_trees(draft_ids, [v.shape for v in inputs], best) if has_trees \
            else greedy_chains(draft_ids, num_draft, best)
    else:
        row_params = [v.params for v, size in zip(inputs, sizes, strict=True) for _ in range(size)]
        sampled_rows = [r for r, p in enumerate(row_params) if not p.is_greedy]
        if sampled_rows:
            index = to_device(sampled_rows, device=device)
            masked = masked.index_copy(0, index, processed_probs(masked.index_select(0, index),
                                                                 [row_params[r] for r in sampled_rows]))
        target = torch.zeros(num_seqs, max_k + 1, vocab, dtype=torch.float32, device=device)
        target[seq_of_row, pos_of_row] = masked
        is_greedy_host = [v.params.is_greedy for v in inputs]
        noise = draw_rejection_noise(
            [size - 1 for size in sizes], [v.generator for v in inputs], is_greedy_host, vocab, device,
            default_generator=sampler.default_generator(device),
        )
        is_greedy = to_device(is_greedy_host, dtype=torch.bool, device=device)
        rs = _rejection_sample(draft_ids[:, :max_k], num_draft, target, is_greedy, noise)
        out = VerifyOutput(rs.token_ids, rs.num_accepted)
    if any(v.params.logprobs is not None for v in inputs):  # reads the results: a host sync
        branches = out.branch.tolist() if out.branch is not None else None
        out.logprobs = _logprobs(raw, inputs, sizes, out.emitted(), branches)
    return out


def _verify_apart(
    logits: torch.Tensor,
    inputs: Sequence[VerifyInput],
    sizes: list[int],
    sampler: Sampler,
    num_suppressed: torch.Tensor | None,
    raw_logits: torch.Tensor,
) -> VerifyOutput:
    """Greedy chunks (trees among them) and sampled ones verified as two batches, merged back in order."""
    device = logits.device
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    groups = [[i for i, v in enumerate(inputs) if v.params.is_greedy == greedy] for greedy in (True, False)]
    parts = []
    for group in groups:
        rows = to_device([starts[i] + j for i in group for j in range(sizes[i])], device=device)
        index = to_device(group, device=device)
        parts.append((index, verify_drafts(logits[rows], [inputs[i] for i in group], sampler,
                                           num_suppressed[index] if num_suppressed is not None else None,
                                           raw_logits[rows])))
    width = max(p.token_ids.shape[1] for _, p in parts)
    token_ids = torch.full((len(inputs), width), -1, dtype=torch.int64, device=device)
    branch = torch.zeros((len(inputs), width), dtype=torch.int64, device=device)
    num_accepted = torch.zeros(len(inputs), dtype=torch.int64, device=device)
    logprobs: list[list[TokenLogprobs]] = [[] for _ in inputs]
    for (index, part), group in zip(parts, groups, strict=True):
        w = part.token_ids.shape[1]
        token_ids[index, :w] = part.token_ids
        num_accepted[index] = part.num_accepted
        branch[index, :w] = part.branch if part.branch is not None else torch.arange(w, device=device)
        for i, lps in zip(group, part.logprobs, strict=False):
            logprobs[i] = lps
    return VerifyOutput(token_ids, num_accepted, logprobs if any(logprobs) else [], branch)


def greedy_trees(
    draft_ids: torch.Tensor,  # [num_chunks, max_n + 1] int64: chunk i's drafts (its nodes 1..n) then -1
    trees: Sequence[DraftTree],  # per chunk, with n drafts
    best: torch.Tensor,  # [num_chunks, max_n + 1] int64: the target's argmax at each node (-1 past n)
) -> VerifyOutput:
    """Greedy acceptance over draft trees: the deepest node whose whole branch holds the target's picks.

    A node matches when its token is the target's argmax at its parent; it is accepted when it and every
    ancestor match. Siblings hold distinct guesses, so at most one branch is accepted; the emitted tokens
    are its drafts, then the target's argmax at its last node. On the device, no host sync.
    """
    device = draft_ids.device
    num_chunks, width = draft_ids.shape
    max_depth = max(t.max_depth for t in trees)
    pad = [0] * max_depth
    parents = to_device([[max(p, 0) for p in t.parents] + [0] * (width - len(t.parents)) for t in trees],
                        device=device)
    depths = to_device([list(t.depths) + [-1] * (width - len(t.parents)) for t in trees], device=device)
    branches = to_device([[list(row) + pad[: max_depth + 1 - len(row)] for row in t.branch_table]
                          + [[0] * (max_depth + 1)] * (width - len(t.parents)) for t in trees], device=device)
    # node 0 holds the last known token, drafted by no one: a match by definition (-1 never equals an argmax)
    node_ids = draft_ids.roll(1, dims=1)
    node_ids[:, 0] = -1
    match = node_ids == best.gather(1, parents)
    match[:, 0] = True
    accepted = match
    for _ in range(max_depth):
        accepted = match & accepted.gather(1, parents)
    num_accepted, deepest = torch.where(accepted, depths, -1).max(dim=1)
    branch = branches[torch.arange(num_chunks, device=device), deepest]  # [num_chunks, max_depth + 1]
    at = torch.arange(max_depth + 1, device=device).unsqueeze(0)
    n = num_accepted.unsqueeze(1)
    branch = torch.where(at <= n, branch, 0)
    drafts = torch.nn.functional.pad(node_ids.gather(1, branch[:, 1:]), (0, 1), value=-1)
    last = best.gather(1, branch.gather(1, n))
    token_ids = torch.where(at < n, drafts, torch.where(at == n, last, -1))
    return VerifyOutput(token_ids, num_accepted, branch=branch)


def greedy_chains(
    draft_ids: torch.Tensor,  # [num_chunks, max_k + 1] int64, -1 past each chunk's drafts
    num_draft: torch.Tensor,  # [num_chunks] int64
    best: torch.Tensor,  # [num_chunks, max_k + 1] int64: the target's argmax at each position
) -> VerifyOutput:
    """All-greedy batches: accept drafts while they equal the argmax, then emit the argmax.

    What the rejection sampler computes for greedy rows, without its
    [num_chunks, max_k + 1, vocab] work, and without leaving the device.
    """
    pos = torch.arange(draft_ids.shape[1], device=draft_ids.device)
    match = (draft_ids == best) & (pos < num_draft.unsqueeze(1))
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    at = pos.unsqueeze(0)
    n = num_accepted.unsqueeze(1)
    token_ids = torch.where(at < n, draft_ids, torch.where(at == n, best, -1))
    return VerifyOutput(token_ids, num_accepted)


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
    branches: list[list[int]] | None,  # VerifyOutput.branch read back; None: chains
) -> list[list[TokenLogprobs]]:
    """Raw logprobs of each emitted token, from the row that scored it (the accepted branch's, in a tree)."""
    result: list[list[TokenLogprobs]] = [[] for _ in inputs]
    wanted = [i for i, v in enumerate(inputs) if v.params.logprobs is not None]
    if not wanted:
        return result
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    rows = [starts[i] + (branches[i][j] if branches is not None else j) for i in wanted for j in range(len(emitted[i]))]
    token_ids = to_device([t for i in wanted for t in emitted[i]], device=logits.device)
    params = [inputs[i].params for i in wanted for _ in emitted[i]]
    flat = raw_logprobs(logits[to_device(rows, device=logits.device)], token_ids, params)
    k = 0
    for i in wanted:
        for _ in emitted[i]:
            lp = flat[k]
            assert lp is not None
            result[i].append(lp)
            k += 1
    return result
