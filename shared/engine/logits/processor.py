"""The logits pipeline: one pass over the rows a step samples, the same wherever a token is sampled.

    raw logits [rows, vocab]
      ├ logit_bias                 (added to the named tokens)
      ├ repetition penalty         (tokens in the prompt or the output: / p where > 0, * p elsewhere)
      ├ frequency / presence       (- f * count - p * [count > 0], over the output)
      └ constraint                 (grammar bitmask, or the one forced token; -inf elsewhere)
    processed logits ──► sampler: greedy argmax, or temperature → min_p → top-k → top-p → draw
                     └─► verification of drafts (each draft position its own row)

Raw logits stay untouched for logprobs (vLLM's default `raw_logprobs`).

A row belongs to a request and a position: the next position of a plain sampling
chunk, or one position of a verification chunk (before or after some of its
drafts). The request's `RequestLogits` gives the constraint there; penalties count
the output plus the drafts before the position. The grammar constraint comes
before temperature and top-k/top-p, as in vLLM and SGLang: filtering first could
leave a row with no allowed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from shared.engine.logits.request_state import FREE, Constraint, RequestLogits
from shared.engine.request import SamplingParams
from shared.ops.host_copy import to_device
from shared.spec.tree import DraftTree

__all__ = ["LogitsRows", "RowGroup", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (xgrammar's layout: bit i % 32 of word i // 32)."""
    return -(-vocab_size // 32)


@dataclass(frozen=True)
class RowGroup:
    """The consecutive rows of one chunk: 1 for plain sampling, drafts + 1 for verification."""

    state: RequestLogits | None  # None: the request has nothing to process (rows pass through)
    drafts: Sequence[int] = ()
    tree: DraftTree | None = None

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1


@dataclass
class LogitsRows:
    """What the pipeline does to a batch of rows; built on the host, applied on the logits' device."""

    num_rows: int
    vocab_size: int
    constraints: list[Constraint] = field(default_factory=list)  # per row
    bitmask: torch.Tensor | None = None  # [num_rows, words] int32 on the host
    params: list[SamplingParams | None] = field(default_factory=list)  # per row; None: nothing to do
    # per row that penalizes: (row, output token counts at that position, prompt ids)
    penalized: list[tuple[int, dict[int, int], list[int]]] = field(default_factory=list)

    @classmethod
    def build(cls, groups: Sequence[RowGroup], vocab_size: int) -> LogitsRows | None:
        """Sync nothing, compute the constraints and penalty inputs of each group's rows; None when no row
        has anything to do. Each group's state must already be synced to its history."""
        if all(g.state is None for g in groups):
            return None
        num_rows = sum(g.num_rows for g in groups)
        rows = cls(num_rows, vocab_size)
        rows.bitmask = torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)
        lo = 0
        for g in groups:
            hi = lo + g.num_rows
            if g.state is None:
                rows.constraints.extend([FREE] * g.num_rows)
                rows.params.extend([None] * g.num_rows)
            else:
                rows._add_group(g, g.state, lo, hi)
            lo = hi
        return rows

    def _add_group(self, g: RowGroup, state: RequestLogits, lo: int, hi: int) -> None:
        assert self.bitmask is not None
        mask = self.bitmask[lo:hi]
        if g.tree is not None:
            constraints = state.tree_constraints(g.tree, g.drafts, mask)
        elif g.drafts:
            constraints = state.chain_constraints(g.drafts, mask)
        else:
            constraints = [state.constraint(mask[0])]
        self.constraints.extend(constraints)
        self.params.extend([state.params] * g.num_rows)
        if state.params.penalizes:
            for j in range(g.num_rows):
                counts = dict(state.counts)
                for token_id in _trial_tokens(g, j):
                    counts[token_id] = counts.get(token_id, 0) + 1
                self.penalized.append((lo + j, counts, state.prompt_ids))

    @property
    def is_constrained(self) -> list[bool]:
        """Per row: a grammar or forced token decides what it may emit (min_tokens suppression yields)."""
        return [c.grammar or c.forced is not None for c in self.constraints]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] -> a processed copy
        assert logits.shape[0] == self.num_rows, (tuple(logits.shape), self.num_rows)
        out = logits.clone()
        self._apply_bias(out)
        if self.penalized:
            self._apply_penalties(out)
        self._apply_constraints(out)
        return out

    def _apply_bias(self, out: torch.Tensor) -> None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        vocab = out.shape[1]
        for r, p in enumerate(self.params):
            if p is not None:
                for token_id, bias in p.logit_bias:
                    if token_id < vocab:  # ids past the model's vocabulary can never be produced
                        rows.append(r)
                        cols.append(token_id)
                        values.append(bias)
        if rows:
            dev = out.device
            out.index_put_((to_device(rows, device=dev), to_device(cols, device=dev)),
                           to_device(values, dtype=out.dtype, device=dev), accumulate=True)

    def _apply_penalties(self, out: torch.Tensor) -> None:
        dev, vocab = out.device, out.shape[1]
        rows = [r for r, _, _ in self.penalized]
        counts_idx: tuple[list[int], list[int]] = ([], [])
        count_values: list[float] = []
        prompt_idx: tuple[list[int], list[int]] = ([], [])
        for i, (_, counts, prompt_ids) in enumerate(self.penalized):
            for token_id, count in counts.items():
                if token_id < vocab:
                    counts_idx[0].append(i)
                    counts_idx[1].append(token_id)
                    count_values.append(float(count))
            prompt_idx[0].extend([i] * len(prompt_ids))
            prompt_idx[1].extend(prompt_ids)
        counts_t = torch.zeros((len(rows), vocab), dtype=out.dtype, device=dev)  # [P, vocab]
        if count_values:
            counts_t[to_device(counts_idx[0], device=dev), to_device(counts_idx[1], device=dev)] = \
                to_device(count_values, dtype=out.dtype, device=dev)
        seen = counts_t > 0  # [P, vocab]
        params = [self.params[r] for r in rows]
        assert all(p is not None for p in params)
        rep = to_device([p.repetition_penalty for p in params if p is not None], dtype=out.dtype, device=dev)
        freq = to_device([p.frequency_penalty for p in params if p is not None], dtype=out.dtype, device=dev)
        pres = to_device([p.presence_penalty for p in params if p is not None], dtype=out.dtype, device=dev)
        row_index = to_device(rows, device=dev)
        x = out.index_select(0, row_index)  # [P, vocab]
        in_prompt = torch.zeros_like(seen)
        if prompt_idx[0]:
            in_prompt[to_device(prompt_idx[0], device=dev), to_device(prompt_idx[1], device=dev)] = True
        repeated = seen | in_prompt
        rep_col = rep.unsqueeze(1)
        x = torch.where(repeated, torch.where(x > 0, x / rep_col, x * rep_col), x)
        x = x - freq.unsqueeze(1) * counts_t - pres.unsqueeze(1) * seen.to(out.dtype)
        out.index_copy_(0, row_index, x)

    def _apply_constraints(self, out: torch.Tensor) -> None:
        """Tokens outside a row's bitmask to -inf (xgrammar's kernel: C++ on the CPU, Triton on CUDA)."""
        assert self.bitmask is not None
        rows = [r for r, c in enumerate(self.constraints) if c.grammar or c.forced is not None]
        if not rows:
            return
        vocab = out.shape[1]
        bitmask = self.bitmask
        for r in rows:
            c = self.constraints[r]
            if c.forced is not None:
                bitmask[r] = 0
            token = c.forced if c.forced is not None else c.also_allowed
            if token is not None and token < vocab:
                _set_bit(bitmask[r], token)
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True), indices=rows)


def _set_bit(row: torch.Tensor, token_id: int) -> None:  # row: [words] int32
    bit = token_id % 32
    value = 1 << bit
    row[token_id // 32] |= value - (1 << 32) if bit == 31 else value  # bit 31 is the int32 sign bit


def _trial_tokens(g: RowGroup, row: int) -> list[int]:
    """The drafts before row `row` of a group: a chain's first `row`, or a tree node's path."""
    if g.tree is None:
        return list(g.drafts[:row])
    path: list[int] = []
    node = row
    while node > 0:
        path.append(g.drafts[node - 1])
        node = g.tree.parents[node]
    return path[::-1]
