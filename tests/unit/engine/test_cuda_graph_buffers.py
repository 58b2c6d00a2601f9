"""Decode-graph static buffers on the CPU: padding rows change nothing but the scratch block.

Capture and replay need CUDA (tests/integration/engine/test_cuda_graphs.py); what a
graph reads is `DecodeGraphs.load`'s work, and that runs anywhere. Here a decode
step through the padded static buffers (eager forward, torch reference attention)
must give the unpadded step's hidden states and KV cache (to float rounding: a GEMM
of 4 rows may block differently from one of 3), with the padding rows' writes
confined to the scratch block.
"""

from __future__ import annotations

import torch

from shared.engine.cuda_graphs import DecodeGraphs, capture_sizes
from shared.kv.layout import KVLayout
from shared.ops.attention import AttentionMetadata
from tests.helpers.models import tiny_loaded

BLOCK = 4


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(12) == [1, 2, 4, 8, 16]
    assert capture_sizes(64)[-1] == 64
    assert capture_sizes(10_000)[-1] == 256
    for n in range(1, 65):
        assert any(s >= n for s in capture_sizes(n))


def _meta(tables: list[list[int]], seq_lens: list[int], query_lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions, slots = [], []
    for t, s, q in zip(tables, seq_lens, query_lens, strict=True):
        for p in range(s - q, s):
            positions.append(p)
            slots.append(t[p // BLOCK] * BLOCK + p % BLOCK)
    pos = torch.tensor(positions)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots), qsl, torch.tensor(seq_lens, dtype=torch.int32), bt,
                             list(query_lens), list(seq_lens), positions=pos)
    return meta, pos


def test_padded_decode_step_equals_the_unpadded_one_and_writes_only_scratch() -> None:
    loaded, _ = tiny_loaded("llama", device="cpu")  # this test's tensors are on the CPU, wherever tests run
    model = loaded.model
    num_blocks = 16
    scratch = num_blocks - 1
    layout = KVLayout(model.num_layers, num_blocks, BLOCK, model.num_kv_heads, model.head_dim, model.dtype)
    kv = layout.allocate()
    tables = [[3, 7], [1], [9, 2, 4]]
    prompt_lens = [6, 3, 9]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen) for n in prompt_lens]
    meta, pos = _meta(tables, prompt_lens, prompt_lens)
    model.forward(torch.cat(prompts), pos, kv, meta)

    next_ids = torch.tensor([11, 12, 13])
    step_meta, step_pos = _meta(tables, [n + 1 for n in prompt_lens], [1, 1, 1])
    eager_kv = kv.clone()
    want = model.forward(next_ids, step_pos, eager_kv, step_meta)

    graphs = DecodeGraphs([1, 2, 4, 8], max_blocks_per_seq=4, block_size=BLOCK, scratch_block=scratch,
                          device=torch.device("cpu"))
    # a previous, larger step left live rows in the buffers: load must turn them into padding
    graphs.load(8, torch.arange(8), torch.arange(8), _meta([[5]] * 8, [2] * 8, [1] * 8)[0])
    size = graphs.size_for(3)
    assert size == 4
    graphs.load(size, next_ids, step_pos, step_meta)
    padded_kv = kv.clone()
    got = model.forward(graphs.input_ids[:size], graphs.positions[:size], padded_kv, graphs.meta(size))

    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    # every real block as the eager step left it (a stray padding write would differ by O(1))
    torch.testing.assert_close(padded_kv[:, :scratch], eager_kv[:, :scratch], rtol=1e-5, atol=1e-5)
    assert not torch.equal(padded_kv[:, scratch], kv[:, scratch])  # the padding row wrote its K/V there
    assert graphs.slot_mapping[3:4].tolist() == [scratch * BLOCK]
    assert graphs.block_tables[3, 0].item() == scratch and graphs.seq_lens[3].item() == 1


def test_fits_only_single_token_steps_within_the_captured_sizes() -> None:
    graphs = DecodeGraphs([1, 2, 4], max_blocks_per_seq=4, block_size=BLOCK, scratch_block=9,
                          device=torch.device("cpu"))
    assert graphs.fits(_meta([[1], [2]], [3, 2], [1, 1])[0])
    assert not graphs.fits(_meta([[1], [2]], [3, 2], [2, 1])[0])  # a chunk of two tokens
    assert not graphs.fits(_meta([[i] for i in range(5)], [1] * 5, [1] * 5)[0])  # more sequences than 4
    assert not graphs.fits(_meta([[1, 2, 3, 4, 5]], [18], [1])[0])  # a longer block table than captured


def test_the_load_kernel_fills_the_buffers_as_the_torch_ops_do() -> None:
    """graph_inputs_triton.py (through the interpreter here) against `load_reference`, over steps that shrink,
    so rows that held a sequence become padding, and a block table wider than the last step's."""
    from shared.ops.graph_inputs_triton import load_graph_inputs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled, or the interpreter
    kernel = DecodeGraphs([1, 2, 4, 8], 6, BLOCK, 30, device)
    torch_ops = DecodeGraphs([1, 2, 4, 8], 6, BLOCK, 30, device)
    for tables, seq_lens in (([[3, 7, 8, 9], [1], [9, 2, 4], [5], [6, 11], [12]], [15, 2, 10, 4, 7, 1]),
                             ([[3, 7], [1, 13]], [6, 5])):
        meta, pos = _meta(tables, seq_lens, [1] * len(tables))
        meta.slot_mapping, meta.seq_lens = meta.slot_mapping.to(device), meta.seq_lens.to(device)
        meta.block_tables, pos = meta.block_tables.to(device), pos.to(device)
        n = len(tables)
        ids = torch.arange(100, 100 + n, device=device)
        size = kernel.size_for(n)
        assert size is not None
        load_graph_inputs(kernel._static(), (ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables), size,
                          kernel.scratch_slot, kernel.scratch_block)
        torch_ops.load_reference(size, ids, pos, meta)
        for got, want in zip(kernel._static(), torch_ops._static(), strict=True):
            assert torch.equal(got[:size], want[:size])
