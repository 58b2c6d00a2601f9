"""`prepare_step_inputs_ref` against a plain loop over its docstring, its Triton twin against it, and its
host case (`host_step_inputs`: nothing before, the CPU's synchronous loop) against it.

Cases are built the way the host plans them: every sequence has a true first
position; one continuing from a previous output row is planned `shift` tokens
further on (as if all its drafts were accepted) with a placeholder first id,
and its block table covers that optimistic plan. Tables are drawn shuffled so
they are non-contiguous.

The reference tests need no triton. Without CUDA, conftest switches Triton to
its interpreter and the kernel runs on CPU tensors (small shapes: it is slow);
the `gpu`-marked test compiles the kernel for a decode-sized batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from shared.ops import step_inputs_triton
from shared.ops.step_inputs import PrevOutputs, StepInputsOut, host_step_inputs, prepare_step_inputs_ref

PLACEHOLDER_ID = -7
VOCAB = 1000


def test_triton_runs_here() -> None:
    """triton is a dependency: without CUDA, conftest turns its interpreter on, so its paths always run."""
    assert step_inputs_triton.triton_available()


@dataclass
class StepCase:
    """The arguments of `prepare_step_inputs_*`, in order."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
    prev_row: torch.Tensor  # [S] int64
    prev: PrevOutputs
    block_size: int

    def args(self) -> tuple:
        return (
            self.input_ids, self.positions, self.seq_lens, self.query_start_loc,
            self.block_tables, self.prev_row, self.prev, self.block_size,
        )  # fmt: skip

    def to(self, device: str) -> StepCase:
        p = self.prev
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            seq_lens=self.seq_lens.to(device),
            query_start_loc=self.query_start_loc.to(device),
            block_tables=self.block_tables.to(device),
            prev_row=self.prev_row.to(device),
            prev=PrevOutputs(p.emitted.to(device), p.num_emitted.to(device), p.num_drafts.to(device)),
        )


def make_prev(num_rows: int, max_k: int, gen: torch.Generator) -> PrevOutputs:
    """Rows that verified 0..max_k drafts and accepted any number of them; -1 after the emitted ids."""
    num_drafts = torch.randint(0, max_k + 1, (num_rows,), generator=gen)
    num_emitted = (torch.rand(num_rows, generator=gen) * (num_drafts + 1)).long() + 1
    emitted = torch.randint(0, VOCAB, (num_rows, max_k + 1), generator=gen)
    emitted[torch.arange(max_k + 1) >= num_emitted.unsqueeze(1)] = -1
    return PrevOutputs(emitted, num_emitted, num_drafts)


def make_case(
    num_seqs: int,
    num_rows: int,
    block_size: int,
    seed: int,
    max_query_len: int = 17,
    max_k: int = 4,
) -> StepCase:
    """`num_seqs` sequences, about half continuing from distinct rows of a `num_rows`-row `prev`."""
    gen = torch.Generator().manual_seed(seed)
    prev = make_prev(num_rows, max_k, gen) if num_rows else PrevOutputs.empty("cpu")
    rows = torch.randperm(num_rows, generator=gen).tolist()
    ids, positions, seq_lens, query_lens, tables, prev_rows = [], [], [], [], [], []
    for _ in range(num_seqs):
        takes = bool(rows) and torch.rand(1, generator=gen).item() < 0.6
        row = rows.pop() if takes else -1
        shift = int(prev.num_drafts[row] - (prev.num_emitted[row] - 1)) if takes else 0
        query_len = int(torch.randint(1, max_query_len + 1, (1,), generator=gen))
        true_start = int(torch.randint(0, 50, (1,), generator=gen))
        planned_start = true_start + shift
        seq_ids = torch.randint(0, VOCAB, (query_len,), generator=gen)
        if takes:
            seq_ids[0] = PLACEHOLDER_ID
        ids.append(seq_ids)
        positions.append(torch.arange(planned_start, planned_start + query_len))
        seq_lens.append(planned_start + query_len)
        query_lens.append(query_len)
        tables.append(-(-(planned_start + query_len) // block_size))
        prev_rows.append(row)
    # shuffled block ids, one pool for the batch; extra zero columns pad every table
    width = max(tables) + 2
    pool = (torch.randperm(sum(tables) + 8, generator=gen) + 1).tolist()
    block_tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    for s, n in enumerate(tables):
        block_tables[s, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    return StepCase(
        input_ids=torch.cat(ids),
        positions=torch.cat(positions),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        block_tables=block_tables,
        prev_row=torch.tensor(prev_rows, dtype=torch.int64),
        prev=prev,
        block_size=block_size,
    )


def docstring_loop(case: StepCase) -> StepInputsOut:
    """The module docstring's pseudo-code, line by line, over Python ints."""
    ids, positions = case.input_ids.tolist(), case.positions.tolist()
    seq_lens, qsl = case.seq_lens.tolist(), case.query_start_loc.tolist()
    tables, prev_row = case.block_tables.tolist(), case.prev_row.tolist()
    emitted, num_emitted = case.prev.emitted.tolist(), case.prev.num_emitted.tolist()
    num_drafts, bs = case.prev.num_drafts.tolist(), case.block_size
    slots = [0] * len(ids)
    for s, r in enumerate(prev_row):
        shift = 0
        if r >= 0:
            n = num_emitted[r]
            shift = num_drafts[r] - (n - 1)
            ids[qsl[s]] = emitted[r][n - 1]
            seq_lens[s] -= shift
        for t in range(qsl[s], qsl[s + 1]):
            positions[t] -= shift
            pos = positions[t]
            slots[t] = tables[s][pos // bs] * bs + pos % bs
    return StepInputsOut(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def assert_same(out: StepInputsOut, want: StepInputsOut) -> None:
    for name in ("input_ids", "positions", "seq_lens", "slot_mapping"):
        got, exp = getattr(out, name), getattr(want, name)
        assert got.dtype == exp.dtype, (name, got.dtype, exp.dtype)
        assert torch.equal(got.cpu(), exp.cpu()), (name, got, exp)


# (num_seqs, num_rows, block_size, seed): rows beyond the continuing sequences stay unused
CASES = [
    (1, 1, 4, 0),
    (6, 4, 4, 1),
    (9, 12, 16, 2),
    (12, 5, 4, 3),
    (8, 8, 16, 4),
    (7, 0, 16, 5),  # R == 0: nothing came before
]
CASE_IDS = [f"s{s}-r{r}-bs{b}" for s, r, b, _ in CASES]


@pytest.mark.parametrize(("num_seqs", "num_rows", "block_size", "seed"), CASES, ids=CASE_IDS)
def test_reference_matches_docstring(num_seqs: int, num_rows: int, block_size: int, seed: int) -> None:
    case = make_case(num_seqs, num_rows, block_size, seed)
    assert_same(prepare_step_inputs_ref(*case.args()), docstring_loop(case))


def test_reference_fills_every_placeholder_and_keeps_its_inputs() -> None:
    case = make_case(12, 12, 4, seed=6)
    before = [t.clone() for t in case.args()[:6]]
    out = prepare_step_inputs_ref(*case.args())
    assert (case.prev_row >= 0).any() and (case.prev_row < 0).any()
    assert not (out.input_ids == PLACEHOLDER_ID).any()
    assert (out.positions >= 0).all() and (out.seq_lens > 0).all()
    for t, b in zip(case.args()[:6], before, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize(("num_seqs", "num_rows", "block_size", "seed"), CASES, ids=CASE_IDS)
def test_host_case_matches_reference_with_nothing_before(num_seqs: int, num_rows: int, block_size: int,
                                                         seed: int) -> None:
    """Prompt chunks and decode rows alike (query lengths 1..17), every sequence planned from its truth."""
    case = make_case(num_seqs, num_rows, block_size, seed)
    case.prev_row = torch.full_like(case.prev_row, -1)
    query_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    out = host_step_inputs(case.input_ids, case.positions, case.seq_lens, query_lens, case.block_tables,
                           block_size)
    assert_same(out, prepare_step_inputs_ref(*case.args()))
    assert_same(out, prepare_step_inputs_ref(*replace(case, prev=PrevOutputs.empty("cpu")).args()))


@pytest.mark.parametrize("block", [None, 4], ids=["one-tile", "tiles-of-4"])
@pytest.mark.parametrize(("num_seqs", "num_rows", "block_size", "seed"), CASES, ids=CASE_IDS)
def test_triton_matches_reference(
    num_seqs: int, num_rows: int, block_size: int, seed: int, block: int | None
) -> None:
    case = make_case(num_seqs, num_rows, block_size, seed)
    out = step_inputs_triton.prepare_step_inputs_triton(*case.args(), block=block)
    assert_same(out, prepare_step_inputs_ref(*case.args()))


def test_triton_int64_seq_lens_and_no_sequences() -> None:
    case = make_case(5, 3, 16, seed=7)
    case.seq_lens = case.seq_lens.long()
    case.block_tables = case.block_tables.long()
    out = step_inputs_triton.prepare_step_inputs_triton(*case.args())
    assert_same(out, prepare_step_inputs_ref(*case.args()))
    i64, i32 = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
    empty = StepCase(i64, i64, i32, torch.zeros(1, dtype=torch.int32), i32.view(0, 0), i64, case.prev, 16)
    out = step_inputs_triton.prepare_step_inputs_triton(*empty.args())
    assert out.input_ids.shape == (0,) and out.seq_lens.shape == (0,)


def test_triton_rejects_bad_inputs() -> None:
    case = make_case(3, 3, 4, seed=9)
    prepare = step_inputs_triton.prepare_step_inputs_triton
    with pytest.raises(AssertionError, match="int64"):
        prepare(*replace(case, input_ids=case.input_ids.int()).args())
    with pytest.raises(AssertionError, match="query_start_loc"):
        prepare(*replace(case, query_start_loc=case.query_start_loc[:-1]).args())
    with pytest.raises(AssertionError, match="contiguous"):
        wide = torch.zeros(3, 2 * case.block_tables.shape[1], dtype=torch.int32)
        prepare(*replace(case, block_tables=wide[:, ::2]).args())
    with pytest.raises(AssertionError, match="power of 2"):
        prepare(*case.args(), block=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 64])
def test_triton_matches_reference_on_gpu(block_size: int) -> None:
    """Compiled kernel, a decode-sized batch with speculative chunks, and no host sync in the launch."""
    case = make_case(256, 300, block_size, seed=10, max_query_len=9, max_k=8).to("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step_inputs_triton.prepare_step_inputs_triton(*case.args())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same(out, prepare_step_inputs_ref(*case.args()))
