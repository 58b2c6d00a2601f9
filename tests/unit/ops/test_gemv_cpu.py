"""The CPU GEMV kernel gives oneDNN's bits, so a few rows through it equal the same rows in a big batch.

`LinearWeight` sends up to GEMV_MAX_ROWS rows through `csrc/gemv_cpu.cpp` and
more through oneDNN. Batch invariance (a request's tokens alone and in a batch) needs the two
to agree exactly, not to a tolerance: these tests compare with `torch.equal` on
the projection shapes of both packaged models. The kernel must build wherever
the tests run, as the attention kernel must.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.ops import linear
from shared.ops.cpu_kernels import cpu_kernels_available
from shared.ops.linear import GEMV_MAX_ROWS, LinearWeight, onednn_available
from tests.helpers.torch_threads import torch_threads

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")), reason="torch built without oneDNN")

# [out, in] of every projection: SmolLM2-135M (qkv, o, gate_up, down, a slice of the LM head) and
# Gemma 3 270M (qkv, o, gate_up, down); oneDNN sums in > 1024 in blocks (and in > 512 on AVX-512)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576),
          (1536, 640), (640, 1024), (4096, 640), (640, 2048), (70, 33)]


def test_kernels_build() -> None:
    assert cpu_kernels_available(), "the C++ CPU kernels did not build (see the log)"


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_few_rows_equal_the_same_rows_in_a_batch(out_features: int, in_features: int, isa_level: str) -> None:
    """At every instruction-set level: each output is the same FMA chain whatever the vector width."""
    g = torch.Generator().manual_seed(out_features * in_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(GEMV_MAX_ROWS + 8, in_features, generator=g)
    lin = LinearWeight(w)
    assert lin.gemv is not None, "the GEMV order check failed for a packaged model's shape"
    batched = lin(x)  # more rows than the kernel takes: oneDNN
    for rows in (1, 2, 3, 8, 13, 16, GEMV_MAX_ROWS):  # 13, 16: several passes, the next panel prefetched
        assert torch.equal(lin(x[:rows]), batched[:rows])
    torch.testing.assert_close(batched, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bits_do_not_depend_on_threads(threads: int, isa_level: str) -> None:
    g = torch.Generator().manual_seed(7)
    lin = LinearWeight(torch.randn(3072, 576, generator=g))
    x = torch.randn(5, 576, generator=g)
    with torch_threads(1):
        one = lin(x)
    with torch_threads(threads):
        assert torch.equal(lin(x), one)


def test_long_inputs_agree_whichever_path_is_kept() -> None:
    """Past 2048 inputs (three sums) the order check decides; either way a row equals its batched self."""
    g = torch.Generator().manual_seed(3)
    lin = LinearWeight(torch.randn(48, 3000, generator=g))
    x = torch.randn(GEMV_MAX_ROWS + 1, 3000, generator=g)
    assert torch.equal(lin(x[:1]), lin(x)[:1])


def test_non_contiguous_rows() -> None:
    w = torch.randn(64, 96)
    x = torch.randn(96, 2).t()  # [2, 96], not contiguous
    lin = LinearWeight(w)
    assert torch.equal(lin(x), lin(torch.cat([x.contiguous(), torch.zeros(GEMV_MAX_ROWS, 96)]))[:2])


def test_turned_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CPU_GEMV", "0")
    assert LinearWeight(torch.randn(64, 96)).gemv is None
    assert linear.gemv_enabled() is False


def test_explicit_backend_keeps_one_path() -> None:
    assert LinearWeight(torch.randn(64, 96), "onednn").gemv is None
    assert LinearWeight(torch.randn(64, 96), "torch").gemv is None


def test_kernel_rejects_a_mismatched_weight() -> None:
    packed = torch.ops.baton_cpu.gemv_pack(torch.randn(64, 96))
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.baton_cpu.gemv(torch.randn(1, 80), packed, 64, 1024)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.baton_cpu.gemv(torch.randn(1, 96), packed, 100, 1024)
    with pytest.raises(RuntimeError, match="k_block"):
        torch.ops.baton_cpu.gemv(torch.randn(1, 96), packed, 64, 0)


def test_large_batch_only_weights_keep_no_copy() -> None:
    lin = LinearWeight(torch.randn(64, 96), small_batches=False)
    assert lin.gemv is None and lin.backend == "onednn"


def test_a_prefill_model_packs_only_its_lm_head() -> None:
    """A prefill engine's projections only see prompt chunks; its LM head still scores one row per
    sequence, so only that weight keeps the GEMV copy (the bits are oneDNN's either way)."""
    from shared.models.decoder import DecoderLM
    from shared.models.families import spec_from_config
    from shared.ops.attention import paged_attention_ref
    from tests.helpers.models import random_hf_model, tiny_llama_config

    config = tiny_llama_config()
    weights = random_hf_model(config).state_dict()
    spec = spec_from_config(config)
    prefill = DecoderLM(spec, weights, paged_attention_ref, decodes=False)
    decode = DecoderLM(spec, weights, paged_attention_ref)
    assert prefill.lm_head.gemv is not None and all(layer.w_qkv.gemv is None for layer in prefill.layers)
    assert all(layer.w_down.gemv is not None for layer in decode.layers)


@pytest.mark.parametrize("in_features", [576, 1536, 2048])
def test_onednn_alone_gives_a_row_its_batched_bits(in_features: int) -> None:
    """Without the kernel too: on AVX-512 oneDNN's one-row path sums K > 1024 in another order than its
    2+ row path, so LinearWeight never runs it on one row."""
    g = torch.Generator().manual_seed(in_features)
    lin = LinearWeight(torch.randn(64, in_features, generator=g) * 0.05, "onednn")
    x = torch.randn(GEMV_MAX_ROWS + 8, in_features, generator=g)
    assert torch.equal(lin(x[:1]), lin(x)[:1])
