"""The packaged SmolLM2 served from its GGUF file's own Q4_1 / Q8_0 blocks (`--quantization gguf`), and in
bf16, int8 and 4-bit blocks made at load, and the packaged Gemma 3 270M from its Q4_K_M file's Q4_K / Q6_K / Q5_0 / Q8_0 blocks: the
weights are the file's, and the logits stay close to fp32's."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import pick_attention
from shared.models.gguf_weights import read_gguf_projections
from shared.models.loader import _gguf_file, load_model
from shared.models.weight_format import WeightFormat
from tests.helpers.models import packaged, reference_logits

TEXT = ("The quick brown fox jumps over the lazy dog. def fibonacci(n):\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\nPhotosynthesis turns light into chemical energy.")


def test_gguf_codes_are_the_weights_transformers_dequantized() -> None:
    """Our reading of the file's blocks (rows un-permuted for Llama's q and k) against the fp32 weights of the
    HF directory transformers wrote from the same file: equal to the bit."""
    loaded = packaged("smollm2-135m")
    codes = read_gguf_projections(_gguf_file("smollm2-135m"), loaded.spec)
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(loaded.hf_dir.glob("*.safetensors")):
        hf.update(load_file(f))
    for i in (0, 17):
        p = f"model.layers.{i}."
        qkv = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(codes[p + "qkv"].dequantize(), qkv)
        assert torch.equal(codes[p + "down"].dequantize(), hf[p + "mlp.down_proj.weight"])
    assert {c.fmt for c in codes.values()} == {"Q4_1", "Q8_0"}
    assert torch.equal(codes["lm_head"].dequantize(), hf["model.embed_tokens.weight"])


@pytest.mark.parametrize(("fmt", "min_top1"), [
    (WeightFormat(torch.bfloat16), 0.97), (WeightFormat(quantization="int8"), 0.9),
    (WeightFormat(quantization="q4_1"), 0.8), (WeightFormat(quantization="gguf"), 0.9)],
    ids=["bf16", "int8", "q4_1", "gguf"])
def test_logits_stay_close_to_fp32(fmt: WeightFormat, min_top1: float) -> None:
    """Teacher-forced over a short text: the top-1 token agrees with fp32's at most positions and the mean
    KL divergence stays small (bench/fidelity.py measures the full text set)."""
    fp32 = packaged("smollm2-135m")
    low = load_model("smollm2-135m", pick_attention("auto", "cpu"), max_model_len=2048, weight_format=fmt)
    ids = fp32.tokenizer(TEXT)["input_ids"]
    ref = reference_logits(fp32.model, ids, block_size=16).log_softmax(-1)
    got = reference_logits(low.model, ids, block_size=16).log_softmax(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert top1 >= min_top1 and kl < 0.05, (top1, kl)


def test_gguf_needs_a_gguf_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="GGUF"):
        _gguf_file(str(tmp_path))


def test_gemma3_k_quant_codes_are_the_weights_transformers_dequantized() -> None:
    """Gemma 3's Q4_K_M file: Q4_K and Q6_K super-blocks, Q5_0 and Q8_0 blocks (q, k, v mixed), read as
    transformers dequantized them, to the bit."""
    from safetensors.torch import load_file

    from shared.models.families import spec_from_config
    from shared.models.loader import read_config, resolve_model

    hf_dir = resolve_model("gemma3-270m")  # the weights, not a model: building one packs 10^8 LM-head weights
    codes = read_gguf_projections(_gguf_file("gemma3-270m"), spec_from_config(read_config(hf_dir)[2]))
    hf = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(f))
    assert {c.fmt for c in codes.values()} >= {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    for i in (0, 1, 17):
        p = f"model.layers.{i}."
        qkv = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(codes[p + "qkv"].dequantize(), qkv)
        assert torch.equal(codes[p + "o"].dequantize(), hf[p + "self_attn.o_proj.weight"])
        assert torch.equal(codes[p + "down"].dequantize(), hf[p + "mlp.down_proj.weight"])


def test_gemma3_served_from_its_gguf_blocks_stays_close_to_fp32() -> None:
    fp32 = packaged("gemma3-270m")
    low = load_model("gemma3-270m", pick_attention("auto", "cpu"), max_model_len=1024,
                     weight_format=WeightFormat(quantization="gguf"))
    assert low.model.layers[0].w_down.backend == "qgemv"
    ids = fp32.tokenizer(TEXT)["input_ids"]
    ref = reference_logits(fp32.model, ids, block_size=16).log_softmax(-1)
    got = reference_logits(low.model, ids, block_size=16).log_softmax(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert top1 >= 0.9 and kl < 0.05, (top1, kl)
