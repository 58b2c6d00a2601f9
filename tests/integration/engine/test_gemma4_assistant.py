"""The gemma4_assistant drafter: its drafts against transformers' Gemma4AssistantForCausalLM on the same target
KV and hidden states, and speculative decoding with it equal to plain greedy (colocated and handed off)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.request import SamplingParams
from shared.kv.layout import KVLayout
from shared.models.gemma4.assistant import Gemma4Assistant, TargetLayerKV
from shared.models.gemma4.tiny import assistant_config, build_assistant
from shared.ops.attention import AttentionMetadata, paged_attention_ref
from tests.helpers.models import tiny_engine, tiny_loaded
from tests.integration.engine.test_engine_tiny import greedy, prompts


def _assistant_dir(tmp_path: Path, target_config: object, ordered: bool = False) -> tuple[Path, object]:
    hf = build_assistant(assistant_config(target_config, ordered_embeddings=ordered), seed=7)
    out = tmp_path / ("assistant-ordered" if ordered else "assistant")
    hf.save_pretrained(out)
    return out, hf


def _our_cache(model: object, layout: KVLayout, token_ids: list[int]) -> tuple[object, torch.Tensor]:
    """Run our target over `token_ids` into a fresh cache (block i of every group at id i)."""
    n, bs = len(token_ids), layout.block_size
    cache = layout.allocate()
    views = layout.model_cache(cache)
    tables = torch.arange(-(-n // bs), dtype=torch.int32)[None]
    pos = torch.arange(n)
    meta = AttentionMetadata(pos.clone(), torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                             tables, [n], [n])
    model.forward(torch.tensor(token_ids), pos, views, meta)  # type: ignore[attr-defined]
    return views, tables


@pytest.mark.parametrize("ordered", [False, True], ids=["lm_head", "ordered_embeddings"])
def test_drafts_equal_transformers_assistant(tmp_path: Path, ordered: bool) -> None:
    loaded, hf_target = tiny_loaded("gemma4-all", device="cpu")
    target = loaded.model
    path, hf_assistant = _assistant_dir(tmp_path, loaded.hf_config, ordered)
    ours = Gemma4Assistant(path, target.w.embed, paged_attention_ref, 512, torch.float32)
    ids = prompts(1, seed=2, lo=21, hi=22)[0]
    context, last = ids[:-1], ids[-1]
    layout = KVLayout.of(loaded.spec.kv_layers, 16, 4, torch.float32)
    views, tables = _our_cache(target, layout, context)
    p = len(context)  # the newest token's position; the cache holds positions < p
    meta = AttentionMetadata(torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1], dtype=torch.int32),
                             torch.tensor([p], dtype=torch.int32), tables, [1], [p],
                             positions=torch.tensor([p - 1]))
    kv = {t: TargetLayerKV(*views[layer], meta, target.keys_from_values(layer))  # type: ignore[index]
          for t, layer in target.store_layers().items()}
    with torch.no_grad():
        out = hf_target(torch.tensor([context]), output_hidden_states=True, return_shared_kv_states=True,
                        use_cache=False)
        hidden = out.hidden_states[-1][:, -1:]
        token = torch.tensor([[last]])
        our_token, our_hidden = torch.tensor([last]), hidden[0]
        for _ in range(3):
            embeds = hf_target.model.embed_tokens(token)
            step = hf_assistant(inputs_embeds=torch.cat([embeds, hidden], dim=-1), position_ids=torch.tensor([[p]]),
                                shared_kv_states=out.shared_kv_states)
            token, hidden = step.logits.argmax(-1), step.last_hidden_state
            our_token, our_hidden = ours.step(our_token, our_hidden, torch.tensor([p]), kv)
            assert our_token.tolist() == token[0].tolist()
            torch.testing.assert_close(our_hidden, hidden[0], atol=1e-4, rtol=1e-4)


def test_speculative_greedy_equals_plain_greedy(tmp_path: Path, engines) -> None:
    loaded, _ = tiny_loaded("gemma4-all")
    path, _ = _assistant_dir(tmp_path, loaded.hf_config)
    batch = prompts(4, seed=6, lo=5, hi=30)
    plain = tiny_engine(loaded)
    engines.append(plain)
    expected = [r.token_ids for r in plain.generate(batch, greedy(20))]
    spec = tiny_engine(loaded, spec_method="gemma4_assistant", spec_draft_model=str(path), num_speculative_tokens=3)
    engines.append(spec)
    params = [greedy(20), greedy(20), SamplingParams(max_tokens=20, min_tokens=20, temperature=0.0), greedy(20)]
    assert [r.token_ids for r in spec.generate(batch, params)] == expected
    stats = spec.speculator.stats  # type: ignore[union-attr]
    assert stats.num_verifications > 0 and stats.num_draft_tokens > 0 and stats.num_fallbacks == 0


def test_handed_off_requests_draft_from_the_prefill_hidden_states(tmp_path: Path, engines) -> None:
    loaded, _ = tiny_loaded("gemma4-all")
    path, _ = _assistant_dir(tmp_path, loaded.hf_config)
    batch = prompts(3, seed=8, lo=10, hi=30)
    colocated = tiny_engine(loaded)
    engines.append(colocated)
    expected = [r.token_ids for r in colocated.generate(batch, greedy(16))]
    prefill = tiny_engine(loaded, role="prefill")
    decode = tiny_engine(loaded, role="decode", spec_method="gemma4_assistant", spec_draft_model=str(path))
    engines.extend([prefill, decode])
    handoffs = prefill.generate(batch, greedy(16))
    for i, h in enumerate(handoffs):
        assert h.handoff is not None and decode.add_handoff(f"d{i}", greedy(16), h.handoff) is None
    results = decode.run_to_completion()
    assert [[h.handoff.first_token_id] + results[f"d{i}"].token_ids for i, h in enumerate(handoffs)] == expected
    assert decode.speculator.stats.num_draft_tokens > 0  # type: ignore[union-attr]
