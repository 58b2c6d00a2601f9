"""The C++ layer loop (shared/models/cpu_layer_loop.py) gives the Python loop's bits, and runs only where it may.

Both loops call the same kernels on the same tensors, so hidden states and the
KV cache they write must be equal, not close: these tests compare with
`torch.equal` on tiny Llama and Gemma 3 models (GQA, sliding windows, q/k norms,
sandwich norms, GELU), over decode rows and a short verify chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from shared.engine.engine import pick_attention
from shared.kv.layout import KVLayout
from shared.models.cpu_layer_loop import CpuLayerLoop
from shared.models.decoder import DecoderLM
from shared.models.families import spec_from_config
from shared.models.weight_format import WeightFormat
from shared.ops.attention import AttentionMetadata
from shared.ops.cpu_kernels import cpu_kernels_available
from shared.ops.linear import GEMV_MAX_ROWS, onednn_available
from shared.spec.draft_model import truncated_model
from tests.helpers.models import random_hf_model, tiny_gemma3_config, tiny_llama_config

pytestmark = pytest.mark.skipif(
    not (cpu_kernels_available() and onednn_available(torch.device("cpu"))),
    reason="the CPU kernels or oneDNN are missing: the loop never builds",
)

BLOCK = 4
# (context already cached, tokens this step): decodes across the tiny Gemma's 8-token sliding window, and a
# verify chunk of 4
DECODE_STEP = [(3, 1), (10, 1), (25, 1), (9, 4), (17, 1)]


def _model(family: str, **kw: object) -> DecoderLM:
    config = tiny_llama_config() if family == "llama" else tiny_gemma3_config()
    spec = spec_from_config(config)
    return DecoderLM(spec, random_hf_model(config).state_dict(), pick_attention("auto", "cpu"), **kw)  # type: ignore[arg-type]


def _step(model: DecoderLM, seqs: Sequence[tuple[int, int]], seed: int = 0, kv_dtype: torch.dtype = torch.float32
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, a cache of random context, metadata) of one step over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // BLOCK) for c, q in seqs]
    layout = KVLayout(model.num_layers, sum(need) + 3, BLOCK, model.num_kv_heads, model.head_dim, model.dtype)
    kv = torch.randn(layout.shape, generator=g).to(kv_dtype)
    free = torch.randperm(layout.num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    slots, positions = [], []
    for i, ((c, q), n) in enumerate(zip(seqs, need, strict=True)):
        tables[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
        pos = torch.arange(c, c + q)
        positions.append(pos)
        slots.append(tables[i].long()[pos // BLOCK] * BLOCK + pos % BLOCK)
    query_lens = [q for _, q in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32),
        block_tables=tables,
        query_lens_host=query_lens,
        seq_lens_host=[c + q for c, q in seqs],
    )
    ids = torch.randint(0, model.vocab_size, (sum(query_lens),), generator=g)
    return ids, torch.cat(positions), kv, meta


def _both_loops(model: DecoderLM, seqs: Sequence[tuple[int, int]], kv_dtype: torch.dtype = torch.float32
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(hidden, cache) after the step through the C++ loop, then through the Python loop from the same cache."""
    ids, pos, kv, meta = _step(model, seqs, kv_dtype=kv_dtype)
    loop = model.cpu_layer_loop
    assert loop is not None
    cpp_kv = kv.clone()
    cpp = model.forward(ids, pos, cpp_kv, meta)
    model.cpu_layer_loop = None
    try:
        py = model.forward(ids, pos, kv, meta)
    finally:
        model.cpu_layer_loop = loop
    return (cpp, cpp_kv), (py, kv)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_decode_step_gives_the_python_loops_bits(family: str, isa_level: str) -> None:
    """At every instruction-set level the loop calls the level's kernels, as the Python loop does."""
    model = _model(family)
    calls = []
    run = model.cpu_layer_loop.run  # type: ignore[union-attr]
    model.cpu_layer_loop.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[union-attr,method-assign]
    (cpp, cpp_kv), (py, py_kv) = _both_loops(model, DECODE_STEP)
    assert calls, "the C++ loop did not run on a decode step"
    assert torch.equal(cpp, py)
    assert torch.equal(cpp_kv, py_kv)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bf16_weights_and_a_bf16_cache(family: str, isa_level: str) -> None:
    """The loop runs bf16 projections and a bf16 cache as the Python loop does, at every level."""
    model = _model(family, weight_format=WeightFormat(torch.bfloat16))
    assert model.cpu_layer_loop is not None and model.layers[0].w_qkv.backend == "gemv_bf16"
    (cpp, cpp_kv), (py, py_kv) = _both_loops(model, DECODE_STEP, kv_dtype=torch.bfloat16)
    assert cpp_kv.dtype == torch.bfloat16
    assert torch.equal(cpp, py)
    assert torch.equal(cpp_kv, py_kv)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_int8_weights(family: str, isa_level: str) -> None:
    """int8 projections (the W8A8 kernel) in the loop give the Python loop's bits."""
    model = _model(family, weight_format=WeightFormat(quantization="int8"))
    assert model.cpu_layer_loop is not None and model.layers[0].w_down.backend == "w8a8"
    (cpp, cpp_kv), (py, py_kv) = _both_loops(model, DECODE_STEP)
    assert torch.equal(cpp, py)
    assert torch.equal(cpp_kv, py_kv)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_every_decode_batch_size_the_kernels_take(family: str) -> None:
    model = _model(family)
    for rows in (1, GEMV_MAX_ROWS):
        (cpp, cpp_kv), (py, py_kv) = _both_loops(model, [(5 + 3 * i, 1) for i in range(rows)])
        assert torch.equal(cpp, py) and torch.equal(cpp_kv, py_kv), f"{rows} rows"


def test_steps_the_kernels_do_not_take_whole_keep_the_python_loop() -> None:
    model = _model("llama")
    loop = model.cpu_layer_loop
    assert loop is not None
    _, _, _, mixed = _step(model, [(0, 12), (7, 1)])  # a prompt chunk goes to the reference attention
    assert loop.rows(13, mixed) is None
    _, _, _, wide = _step(model, [(3, 1)] * (GEMV_MAX_ROWS + 1))  # more rows than the GEMV kernel takes
    assert loop.rows(GEMV_MAX_ROWS + 1, wide) is None
    ids, pos, kv, meta = _step(model, DECODE_STEP)
    done: list[int] = []
    model.forward(ids, pos, kv, meta, on_layer_done=done.append)  # per-layer hooks need the Python loop
    assert done == list(range(model.num_layers))


def test_no_loop_where_some_op_has_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _model("llama", decodes=False).cpu_layer_loop is None  # a prefill engine keeps no GEMV copies
    config = tiny_llama_config()
    reference = DecoderLM(spec_from_config(config), random_hf_model(config).state_dict(), pick_attention("torch", "cpu"))
    assert reference.cpu_layer_loop is None
    monkeypatch.setenv("BATON_CPU_LAYER_LOOP", "0")
    assert _model("llama").cpu_layer_loop is None


def test_a_truncated_draft_gets_a_loop_over_its_own_layers() -> None:
    model = _model("gemma3")
    draft = truncated_model(model, 1)
    assert isinstance(draft.cpu_layer_loop, CpuLayerLoop) and draft.cpu_layer_loop is not model.cpu_layer_loop
    (cpp, cpp_kv), (py, py_kv) = _both_loops(draft, DECODE_STEP)
    assert cpp_kv.shape[0] == 1
    assert torch.equal(cpp, py) and torch.equal(cpp_kv, py_kv)
