"""EAGLE training pipeline on a tiny model: text, hidden states through the prefill path, a head that drafts."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.spec.eagle import target_lm_head
from shared.spec.eagle_head import EagleHead, EagleHeadConfig
from shared.spec.eagle_train import draft_vocabulary, extract_hidden_states, generate_sequences, train_head
from tests.helpers.models import tiny_engine, tiny_loaded
from tests.integration.engine.test_spec_decode import greedy, prompts, spec_stats


def test_trained_head_drafts_what_the_target_says(make_tiny, engines, tmp_path: Path) -> None:
    loaded, _ = tiny_loaded("llama")
    colocated = tiny_engine(loaded)
    prefill = tiny_engine(loaded, role="prefill", enable_prefix_caching=False)
    engines.extend([colocated, prefill])
    train_prompts = prompts(6, seed=3)
    sequences = generate_sequences(colocated, train_prompts, max_tokens=40, samples_per_prompt=2)
    data = extract_hidden_states(prefill, sequences)
    assert [d.token_ids.tolist() for d in data] == sequences
    # labels are the target's greedy picks: on the greedy replies they are the next tokens themselves
    greedy_seq = data[0]
    n = len(train_prompts[0])
    assert greedy_seq.greedy_next[n - 1 : -1].tolist() == greedy_seq.token_ids[n:].tolist()

    model = loaded.model
    head = EagleHead(EagleHeadConfig.from_decoder_spec(model.spec), model.embed, target_lm_head(model),
                     generator=torch.Generator().manual_seed(0), draft_token_ids=draft_vocabulary(data, 128))
    accuracy = train_head(head, data, steps=150, window=32, batch_windows=4, lr=3e-3, depth=3)
    assert accuracy > 0.5
    path = tmp_path / "head.safetensors"
    head.save(path)

    engine, _ = make_tiny("llama", spec_method="eagle", spec_eagle_head=path)
    expected = [r.token_ids for r in colocated.generate(train_prompts, greedy(30))]
    assert [r.token_ids for r in engine.generate(train_prompts, greedy(30))] == expected
    chain = spec_stats(engine).mean_acceptance_length
    assert chain > 1.5  # on its own training prompts

    # a tree holding the chain's branch, and the head's second and third guesses: it accepts more
    tree, _ = make_tiny("llama", spec_method="eagle", spec_eagle_head=path, spec_tree="0;1;2;0.0;0.1;1.0;0.0.0")
    assert [r.token_ids for r in tree.generate(train_prompts, greedy(30))] == expected
    assert spec_stats(tree).mean_acceptance_length > chain, (chain, spec_stats(tree).mean_acceptance_length)
