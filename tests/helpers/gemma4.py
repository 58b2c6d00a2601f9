"""Tiny Gemma 4 configs, one per branch of `Gemma4TextConfig`, and their random transformers models.

Every variant has sliding and full layers with different head dims and KV head
counts, a window shorter than the test prompts, and a final logit softcap; each
adds the feature it is named for. "all" combines every text feature at once;
"unified" is the 12B model's decoder (`gemma4_unified_text`: no PLE, no MoE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shared.models.gemma4.tiny import randomize

TINY_VOCAB = 256

_TYPES4 = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_TYPES6 = ["sliding_attention", "sliding_attention", "full_attention"] * 2
_MOE = dict(enable_moe_block=True, num_experts=6, top_k_experts=2, moe_intermediate_size=24)
_SHARED = dict(num_hidden_layers=6, layer_types=_TYPES6, num_kv_shared_layers=3)

VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {},
    "ple": dict(hidden_size_per_layer_input=8),
    "moe": _MOE,
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "kv_shared": dict(_SHARED, use_double_wide_mlp=True),
    "all": dict(_MOE, **_SHARED, hidden_size_per_layer_input=8, attention_k_eq_v=True, num_global_key_value_heads=1,
                use_double_wide_mlp=True),
    "unified": dict(_SHARED),
}


def tiny_gemma4_config(variant: str = "all", **overrides: Any) -> Any:
    kw: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=6,
        layer_types=_TYPES4,
        max_position_embeddings=512,
        final_logit_softcapping=30.0,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    kw.update(VARIANTS[variant])
    kw.update(overrides)
    if variant == "unified":
        from transformers.models.gemma4_unified import Gemma4UnifiedTextConfig

        return Gemma4UnifiedTextConfig(**kw)
    from transformers import Gemma4TextConfig

    kw.setdefault("hidden_size_per_layer_input", 0)
    kw.setdefault("vocab_size_per_layer_input", TINY_VOCAB)
    return Gemma4TextConfig(**kw)


def random_gemma4(config: Any, seed: int = 0) -> Any:
    """A transformers Gemma4(Unified)ForCausalLM with `randomize`'s weights (shared/models/gemma4/tiny.py)."""
    from transformers import AutoModelForCausalLM

    return randomize(AutoModelForCausalLM.from_config(config).eval(), seed)


def hf_logits(hf: Any, token_ids: list[int]) -> torch.Tensor:  # [n, vocab]
    """transformers' logits at every position. `output_hidden_states` keeps its KV-shared layers on every
    position (without it transformers 5.24 slices them to the last and fails on configs without PLE)."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids]), output_hidden_states=True).logits[0]


def hf_greedy(hf: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation (generate with its own cache; hidden states asked for as in
    `hf_logits`)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                      do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist()  # type: ignore[no-any-return]


def tiny_gemma4_checkpoint(out_dir: Path, **options: Any) -> Path:
    """`baton make-tiny gemma4` into `out_dir`: every text feature on by default, saved multimodal (as published
    checkpoints are), with the packaged Gemma 3 tokenizer as the stand-in."""
    from shared.models.gemma4.tiny import TinyGemma4, write_checkpoint
    from shared.models.loader import resolve_model

    opts: dict[str, Any] = dict(moe=True, k_eq_v=True, kv_shared_layers=2, ple_size=8, double_wide_mlp=True,
                                sliding_window=8, multimodal=True)
    opts.update(options)
    return write_checkpoint(out_dir, TinyGemma4(**opts), resolve_model("gemma3-270m"), max_shard_size="20MB")


def hf_from_checkpoint(path: Path) -> Any:
    """transformers' model of a tiny checkpoint (either architecture), for reference outputs."""
    import json

    from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration
    from transformers.models.gemma4_unified import Gemma4UnifiedForConditionalGeneration

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    classes: dict[str, Any] = {"Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
                               "Gemma4UnifiedForConditionalGeneration": Gemma4UnifiedForConditionalGeneration}
    return classes.get(arch, AutoModelForCausalLM).from_pretrained(path).eval()
