"""The benchmark's Gemma 4 config: a published size's widths at fewer layers, and the bytes a decode step reads."""

from __future__ import annotations

import torch

from bench.engine_gemma4 import fold_prompts, gemma4_step_bytes
from shared.models.gemma4.published import PUBLISHED_TEXT_CONFIGS
from shared.models.gemma4.spec import gemma4_spec
from shared.models.gemma4.text import Gemma4TextLM
from shared.models.gemma4.tiny import published_like_config
from shared.ops.attention import paged_attention_ref
from tests.helpers.gemma4 import random_gemma4, tiny_gemma4_config


def test_published_like_keeps_the_widths_and_experts_at_fewer_layers() -> None:
    published = PUBLISHED_TEXT_CONFIGS["gemma-4-26B-A4B"]
    config = published_like_config("gemma-4-26B-A4B", num_layers=2, vocab_size=32_768)
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_experts", "top_k_experts",
                  "moe_intermediate_size", "attention_k_eq_v", "sliding_window"):
        assert getattr(config, field) == published[field], field
    # head dims and KV heads per layer type (transformers keeps them per layer)
    sliding, full = config.per_layer_config["sliding_attention"], config.per_layer_config["full_attention"]
    assert (sliding.head_dim, sliding.num_key_value_heads) == (published["head_dim"], published["num_key_value_heads"])
    assert (full.head_dim, full.num_key_value_heads) == (published["global_head_dim"],
                                                         published["num_global_key_value_heads"])
    assert config.num_hidden_layers == 2 and config.vocab_size == 32_768 and config.enable_moe_block
    assert config.layer_types == ["sliding_attention", "full_attention"]


def test_step_bytes_count_the_top_k_experts_not_all() -> None:
    config = tiny_gemma4_config("moe")
    hf = random_gemma4(config)
    spec = gemma4_spec(config, 64)
    model = Gemma4TextLM(spec, hf.state_dict(), paged_attention_ref)
    moe = spec.moe
    assert moe is not None
    expert_bytes = 3 * moe.intermediate_size * spec.hidden_size * 4  # gate, up and down rows, fp32
    # every parameter once (the tied embedding as the LM head) but the experts and their gathered scales,
    # the layer scalars, and top_k experts per layer
    dense = sum(p.numel() for n, p in hf.named_parameters() if "experts." not in n and "per_expert_scale" not in n)
    scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))
    assert gemma4_step_bytes(model) == (dense + scalars) * 4 + spec.num_layers * moe.top_k * expert_bytes


def test_fold_prompts_maps_ids_into_the_vocabulary() -> None:
    assert fold_prompts([[5, 70_000], [262_143]], 32_768) == [[5, 70_000 - 65_536], [262_143 % 32_768]]
    assert torch.tensor(fold_prompts([[1, 2]], 256)).tolist() == [[1, 2]]
