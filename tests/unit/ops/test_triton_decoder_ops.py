"""The decoder's Triton elementwise kernels (shared/ops/triton_decoder_ops.py) against the torch ops they replace.

Without CUDA, conftest switches Triton to its interpreter and the kernels run on CPU tensors. In fp32 they must
give the references' values (to the last bits where only a reduction order differs). In bf16 the interpreter
rounds a cast by truncation where a GPU rounds to nearest even, so on a CPU bf16 is held to a bound of four bf16
steps (a value goes through up to three casts); compiled, two. The model tests run tiny Llama and Gemma 3 models
with and without the kernels over a prefill and a decode step on the paged cache.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from shared.engine.engine import pick_attention
from shared.kv.layout import KVLayout
from shared.models.common import RotaryEmbedding, apply_rope, rms_norm, rms_norm_offset
from shared.models.decoder import DecoderLM
from shared.models.families import spec_from_config
from shared.ops.attention import AttentionMetadata, write_kv
from shared.ops.silu_mul_cpu import silu_mul_ref
from tests.helpers.models import random_hf_model, tiny_gemma3_config, tiny_llama_config
from tests.helpers.tolerance import assert_kernel_close

tops = importlib.import_module("shared.ops.triton_decoder_ops")
assert tops.triton_available(), "triton does not run here (neither CUDA nor its interpreter)"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_STEPS = 2 if DEVICE == "cuda" else 4  # the interpreter truncates each bf16 cast, and they chain


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_kernel_close(got, want, 1e-6, BF16_STEPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_add_rms_norm(dtype: torch.dtype, gemma: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(5, 96, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = (torch.randn(96, generator=g) + 1).to(DEVICE, dtype)
    reference = rms_norm_offset if gemma else rms_norm
    total, normed = tops.add_rms_norm(x, delta, weight, 1e-6, weight_in_fp32=gemma)
    assert torch.equal(total, x + delta) or dtype != torch.float32
    _close(total, x + delta)
    _close(normed, reference(x + delta, weight, 1e-6))
    _close(tops.rms_norm(x, weight, 1e-6, weight_in_fp32=gemma), reference(x, weight, 1e-6))


def test_rms_norm_over_heads_of_a_strided_view() -> None:
    """q/k norms take [tokens, heads, head_dim] views out of the qkv projection's output."""
    qkv = torch.randn(3, 8 * 16, device=DEVICE)
    q = qkv[:, :6 * 16].view(3, 6, 16)
    weight = torch.randn(16, device=DEVICE)
    out = tops.rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape
    _close(out, rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype: torch.dtype) -> None:
    gate_up = (3 * torch.randn(4, 2 * 1500, generator=torch.Generator().manual_seed(1))).to(DEVICE, dtype)
    _close(tops.silu_mul(gate_up), silu_mul_ref(gate_up))
    assert tops.silu_mul(gate_up[:0]).shape == (0, 1500)


@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.bfloat16)])
def test_rope_store_kv_matches_rope_then_write_kv(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, block, layers = 6, 2, 16, 4, 2
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(4, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    positions = torch.tensor([5, 0, 9, 30], device=DEVICE)
    slots = torch.tensor([7, 2, 13, -1], device=DEVICE)  # the last token stores nothing
    rope = RotaryEmbedding(head_dim, 10000.0, 32, DEVICE)
    # one layer's keys and values are strided views of the whole cache, as the model passes them
    cache = torch.randn(layers, 5, 2, block, kv_heads, head_dim, generator=g).to(DEVICE, kv_dtype)
    want = cache.clone()
    q = tops.rope_store_kv(qkv, positions, rope.cos, rope.sin, cache[1, :, 0], cache[1, :, 1], slots, heads, kv_heads)
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_ref, k_ref = apply_rope(q_ref.view(-1, heads, head_dim), k_ref.view(-1, kv_heads, head_dim),
                              rope.cos_sin(positions, dtype))
    write_kv(want[1, :, 0], want[1, :, 1], k_ref[:3], v_ref[:3].view(-1, kv_heads, head_dim), slots[:3])
    _close(q, q_ref)
    _close(cache, want)  # layer 0 and every slot not written are untouched


def _forward(model: DecoderLM, seqs: list[tuple[int, int]], kv: torch.Tensor, seed: int,
             captured: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """One step of (context already cached, new tokens) per sequence on consecutive blocks of 4."""
    g = torch.Generator().manual_seed(seed)
    tables, slots, positions, start = [], [], [], 0
    width = max(-(-(c + n) // 4) for c, n in seqs)
    for i, (cached, new) in enumerate(seqs):
        table = torch.arange(i * width, (i + 1) * width, dtype=torch.int32)
        pos = torch.arange(cached, cached + new)
        tables.append(table)
        positions.append(pos)
        slots.append(table.long()[pos // 4] * 4 + pos % 4)
        start += new
    query_lens = [n for _, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                     device=DEVICE),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=DEVICE),
        block_tables=torch.stack(tables).to(DEVICE), query_lens_host=query_lens,
        seq_lens_host=[c + n for c, n in seqs], positions=torch.cat(positions).to(DEVICE))
    ids = torch.randint(0, model.vocab_size, (start,), generator=g).to(DEVICE)
    return model.forward(ids, meta.positions, kv, meta, captured=captured)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_model_with_triton_ops_matches_torch_ops(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill of two prompts, then decode steps of both: hidden states and the cache agree (fp32)."""
    # projections as plain weights, as on CUDA (on the CPU fp32 they are packed for oneDNN, which the GEMV
    # kernel cannot read)
    monkeypatch.setattr("shared.ops.linear.onednn_available", lambda device: False)
    config = tiny_llama_config() if family == "llama" else tiny_gemma3_config()
    spec = spec_from_config(config)
    weights = random_hf_model(config).state_dict()
    attention = pick_attention("triton", DEVICE)
    plain = DecoderLM(spec, weights, attention, device=DEVICE, triton_ops=False)
    fused = DecoderLM(spec, weights, attention, device=DEVICE, triton_ops=True)
    assert fused.triton_ops and not plain.triton_ops
    # Llama's RoPE and KV store run fused; Gemma 3's q/k norms sit between projection and RoPE, so they do not
    assert (fused._rope_store is not None) == (family == "llama")
    # and Llama's decode rows take the GEMV kernels with the norms, adds and SiLU gate folded in
    assert (fused._gemv is not None) == (family == "llama")
    layout = KVLayout(spec.num_layers, 16, 4, spec.num_kv_heads, spec.head_dim, torch.float32)
    kv_plain = torch.zeros(layout.shape, device=DEVICE)
    kv_fused = torch.zeros(layout.shape, device=DEVICE)
    # a prefill of 17 rows (the separate kernels), then decode steps of 2 rows (the GEMV path for Llama), one
    # of them keeping a layer's output as a draft head asks
    for seqs, seed, keep in (([(0, 11), (0, 6)], 3, None), ([(11, 1), (6, 1)], 4, None),
                             ([(12, 1), (7, 1)], 5, 0)):
        kept_plain = {keep: torch.empty(0)} if keep is not None else None
        kept_fused = {keep: torch.empty(0)} if keep is not None else None
        want = _forward(plain, seqs, kv_plain, seed, kept_plain)
        got = _forward(fused, seqs, kv_fused, seed, kept_fused)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv_fused, kv_plain, rtol=1e-5, atol=1e-5)
        if kept_plain is not None and kept_fused is not None:
            torch.testing.assert_close(kept_fused[0], kept_plain[0], rtol=1e-5, atol=1e-5)


def test_default_is_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.models.decoder import use_triton_ops

    assert not use_triton_ops(torch.device("cpu"), None)
    assert use_triton_ops(torch.device("cuda"), None)
    monkeypatch.setenv("BATON_TRITON_DECODER_OPS", "0")
    assert not use_triton_ops(torch.device("cuda"), None)
    assert use_triton_ops(torch.device("cpu"), True)


def test_gemv_is_on_unless_asked_off_or_the_environment_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.models.decoder import use_triton_gemv

    monkeypatch.delenv("BATON_TRITON_GEMV", raising=False)
    assert use_triton_gemv(None) and not use_triton_gemv(False)
    monkeypatch.setenv("BATON_TRITON_GEMV", "0")
    assert not use_triton_gemv(None) and use_triton_gemv(True)


def test_a_model_asked_for_no_gemv_keeps_the_separate_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shared.ops.linear.onednn_available", lambda device: False)
    config = tiny_llama_config()
    weights = random_hf_model(config).state_dict()
    model = DecoderLM(spec_from_config(config), weights, pick_attention("triton", DEVICE), device=DEVICE,
                      triton_ops=True, triton_gemv=False)
    assert model._rope_store is not None and model._gemv is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_model_on_gpu_close_to_torch_ops() -> None:
    """Compiled, in bf16 at SmolLM2's head shapes: the fused model's hidden states stay near the torch ops'."""
    config = tiny_llama_config(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                               intermediate_size=1536)
    spec = spec_from_config(config)
    weights = random_hf_model(config, std=0.05).state_dict()
    attention = pick_attention("auto", "cuda")
    plain = DecoderLM(spec, weights, attention, device="cuda", dtype=torch.bfloat16, triton_ops=False)
    fused = DecoderLM(spec, weights, attention, device="cuda", dtype=torch.bfloat16, triton_ops=True)
    layout = KVLayout(spec.num_layers, 16, 4, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    kv_plain = torch.zeros(layout.shape, device="cuda", dtype=torch.bfloat16)
    kv_fused = torch.zeros_like(kv_plain)
    for seqs, seed in (([(0, 11), (0, 6)], 3), ([(11, 1), (6, 1)], 4)):
        want = _forward(plain, seqs, kv_plain, seed).float()
        got = _forward(fused, seqs, kv_fused, seed).float()
        assert (got - want).abs().max() <= 0.05 * want.abs().max(), (got - want).abs().max()
