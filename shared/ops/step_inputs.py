"""Step inputs finished on the device from the previous step's outputs: the zero-bubble loop's seam.

The host plans step N+1 while step N still runs, so for a request that sampled
in step N it knows neither the token N emitted last nor how many of N's drafts
were accepted. It plans as if every draft were accepted: a placeholder id for
the unknown token, and the positions and context length that would follow.
This op, run on the device right before N+1's forward pass, puts in the truth
from N's outputs where they live, with no device-to-host copy::

    for each sequence s with prev_row[s] = r >= 0 (it continues from N's output row r):
        n     = prev_num_emitted[r]                   accepted drafts + 1
        shift = prev_num_drafts[r] - (n - 1)          drafts N rejected
        input_ids[first token of s]  = prev_emitted[r, n - 1]
        positions[every token of s] -= shift
        seq_lens[s]                 -= shift
    every token t of sequence s:
        slot_mapping[t] = block_tables[s, pos // block_size] * block_size + pos % block_size

Sequences with prev_row = -1 keep their host-planned ids and positions; their
slots are computed the same way. Every sequence has at least one query token. `step_inputs_triton.py` is the GPU twin
(identical results); this reference runs everywhere. `host_step_inputs` is its case with nothing before on
host tensors, which every step of the CPU's synchronous loop is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PrevOutputs", "StepInputsOut", "host_step_inputs", "prepare_step_inputs_ref"]


@dataclass(frozen=True)
class PrevOutputs:
    """What the previous step emitted, one row per sampling chunk, left on the device."""

    emitted: torch.Tensor  # [R, K + 1] int64: accepted drafts then the sampled/bonus token, -1 after
    num_emitted: torch.Tensor  # [R] int64: accepted drafts + 1
    num_drafts: torch.Tensor  # [R] int64: drafts the row verified (0 for plain sampling)

    def rejected(self, prev_row: torch.Tensor) -> torch.Tensor:  # [S] int64
        """Per sequence, the drafts its previous step rejected (0 where `prev_row` is -1 or nothing came before)."""
        if self.num_emitted.shape[0] == 0:
            return torch.zeros_like(prev_row)
        row = prev_row.clamp(min=0)
        return torch.where(prev_row >= 0, self.num_drafts[row] - (self.num_emitted[row] - 1), 0)

    @staticmethod
    def empty(device: torch.device | str) -> PrevOutputs:
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return PrevOutputs(torch.zeros(0, 1, dtype=torch.int64, device=device), z, z)


@dataclass(frozen=True)
class StepInputsOut:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [S] int32
    slot_mapping: torch.Tensor  # [T] int64


def prepare_step_inputs_ref(
    input_ids: torch.Tensor,  # [T] int64, a placeholder where the previous step's token goes
    positions: torch.Tensor,  # [T] int64, as if every draft of the previous step were accepted
    seq_lens: torch.Tensor,  # [S] int32, same assumption
    query_start_loc: torch.Tensor,  # [S + 1] int32
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    prev_row: torch.Tensor,  # [S] int64: row of `prev` that sequence continues from, -1 for none
    prev: PrevOutputs,
    block_size: int,
) -> StepInputsOut:
    """The step's true input ids, positions, context lengths and KV slots (new tensors)."""
    num_seqs = seq_lens.shape[0]
    device = input_ids.device
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    # output_size: without it torch reads the total back to the host
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens,
                                           output_size=input_ids.shape[0])
    takes = prev_row >= 0
    shift = prev.rejected(prev_row)
    if prev.num_emitted.shape[0] > 0:
        row = prev_row.clamp(min=0)
        last = prev.emitted[row, (prev.num_emitted[row] - 1).clamp(min=0)]
    else:  # nothing came before: no sequence may continue from it
        last = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    ids = input_ids.clone()
    first = query_start_loc[:-1].long()
    ids[first] = torch.where(takes, last, ids[first])  # no boolean indexing: it would sync the host
    pos = positions - shift[seq_of_token]
    tables = block_tables.long()
    slot = tables[seq_of_token, pos // block_size] * block_size + pos % block_size
    return StepInputsOut(ids, pos, (seq_lens.long() - shift).to(seq_lens.dtype), slot)


def host_step_inputs(
    input_ids: torch.Tensor,  # [T] int64 on the host
    positions: torch.Tensor,  # [T] int64 on the host
    seq_lens: torch.Tensor,  # [S] int32 on the host
    query_lens: Sequence[int],  # [S]: the tokens of each sequence, as the host planned them
    block_tables: torch.Tensor,  # [S, max_blocks] int32 on the host
    block_size: int,
) -> StepInputsOut:
    """`prepare_step_inputs_ref` where no sequence continues from a previous step's output, on host tensors:
    the planned ids, positions and lengths are the true ones, so only the slots are computed, in numpy. On the
    CPU the reference's ~20 torch ops cost ~270 us a step (a 2-core Zen 3), 2% of a SmolLM2 decode step at
    one row; this ~40 us. The planned tensors are returned as they are (each step plans new ones)."""
    pos = positions.numpy()
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = block_tables.numpy()[seq_of_token, pos // block_size].astype(np.int64) * block_size + pos % block_size
    return StepInputsOut(input_ids, positions, seq_lens, torch.from_numpy(slots))
