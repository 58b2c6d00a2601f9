"""Model factories for tests: tiny random Llama/Gemma 3 and the packaged models.

Tiny models are built offline in well under a second; their weights are drawn
wider than transformers' init so that greedy decoding has clear winners and a
token flip means a real bug, not float noise.

`BATON_TEST_DEVICE=cuda` builds the tiny models and engines on the GPU (Triton
attention, the step-input kernel, the zero-bubble loop's CUDA path), so the
engine suites double as the CUDA path's tests on a machine that has one.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine, pick_attention
from shared.models.common import PagedCausalLM
from shared.models.families import build_model, spec_from_config
from shared.models.loader import LoadedModel, load_model
from shared.models.weight_format import WeightFormat
from shared.ops.attention import paged_attention_ref
from tests.helpers.gemma4 import random_gemma4, tiny_gemma4_config

TINY_VOCAB = 256
TEST_DEVICE = os.environ.get("BATON_TEST_DEVICE", "cpu")


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=1,
        bos_token_id=0,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_gemma3_config(**overrides: Any) -> Any:
    from transformers import Gemma3TextConfig

    kw: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=32,
        eos_token_id=1,
        bos_token_id=2,
    )
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


def random_hf_model(config: Any, seed: int = 0, std: float = 0.2) -> Any:
    """A transformers model with wide random weights (the reference side of comparisons)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


def tiny_loaded(family: str = "llama", seed: int = 0, device: str = TEST_DEVICE,
                weight_format: WeightFormat | None = None, **overrides: Any) -> tuple[LoadedModel, Any]:
    """Our model on the same random weights as the returned transformers model (`weight_format`: how its
    projections are stored, as DecoderLM takes it)."""
    if family.startswith("gemma4"):  # "gemma4" (every feature) or "gemma4-<variant>" (tests/helpers/gemma4.py)
        config = tiny_gemma4_config(family.partition("-")[2] or "all", **overrides)
        hf = random_gemma4(config, seed)
    else:
        config = tiny_llama_config(**overrides) if family == "llama" else tiny_gemma3_config(**overrides)
        hf = random_hf_model(config, seed)
    spec = spec_from_config(config)
    model = build_model(spec, hf.state_dict(), pick_attention("auto", device), device=device,
                        weight_format=weight_format)
    loaded = LoadedModel(
        name=f"tiny-{family}",
        hf_dir=Path("/nonexistent"),
        hf_config=config,
        spec=spec,
        model=model,
        tokenizer=None,
        eos_token_ids=frozenset({1}),
    )
    return loaded, hf


def tiny_loaded_with_tokenizer(family: str = "llama", seed: int = 0, **overrides: Any) -> tuple[LoadedModel, Any]:
    """A tiny model over the byte-level test tokenizer (tests/helpers/tokenizers.py): grammars and templates
    need real token strings. Its vocabulary is the tokenizer's 259 ids, eos id 1."""
    from tests.helpers.tokenizers import BYTE_VOCAB, byte_tokenizer

    loaded, hf = tiny_loaded(family, seed, vocab_size=BYTE_VOCAB, **overrides)
    loaded.tokenizer = byte_tokenizer()
    return loaded, hf


def tiny_engine(loaded: LoadedModel, **config: Any) -> LLMEngine:
    kw: dict[str, Any] = dict(model=loaded.name, block_size=4, num_kv_blocks=256, max_model_len=512,
                              device=TEST_DEVICE)
    kw.update(config)
    return LLMEngine(EngineConfig(**kw), loaded=loaded)


@lru_cache(maxsize=4)
def packaged(name: str, serving: bool = False) -> LoadedModel:
    """A packaged model (smollm2-135m / gemma3-270m), loaded once per test process. With the torch reference
    attention, or with `serving`, as a service runs it here: the CPU kernels and the C++ layer loop."""
    return load_model(name, pick_attention("auto", "cpu") if serving else paged_attention_ref, max_model_len=2048)


def packaged_engine(name: str, serving: bool = False, **config: Any) -> LLMEngine:
    loaded = packaged(name, serving)
    kw: dict[str, Any] = dict(model=name, max_model_len=2048, kv_cache_bytes=192 << 20)
    kw.update(config)
    return LLMEngine(EngineConfig(**kw), loaded=loaded)


def reference_logits(model: PagedCausalLM, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Our model's logits at every position of one sequence (fresh paged cache, shuffled blocks)."""
    from shared.kv.layout import KVLayout
    from shared.ops.attention import AttentionMetadata

    n = len(token_ids)
    num_blocks = -(-n // block_size)
    layout = KVLayout.of(model.spec.kv_layers, num_blocks + 3, block_size, model.dtype)  # type: ignore[attr-defined]
    kv = layout.model_cache(layout.allocate(model.device))
    blocks = torch.randperm(num_blocks + 3, device=model.device)[:num_blocks]
    pos = torch.arange(n, device=model.device)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    meta = AttentionMetadata(
        slots,
        torch.tensor([0, n], dtype=torch.int32, device=model.device),
        torch.tensor([n], dtype=torch.int32, device=model.device),
        blocks[None].int(),
        [n],
        [n],
    )
    hidden = model.forward(torch.tensor(token_ids, device=model.device), pos, kv, meta)
    return model.compute_logits(hidden).cpu()
