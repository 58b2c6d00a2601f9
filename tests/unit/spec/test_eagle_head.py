"""EAGLE draft head: shapes, causality, sharing the target's tensors, safetensors round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.nn.utils.rnn import pad_sequence

from shared.errors import ConfigError
from shared.models.decoder import DecoderSpec
from shared.spec.eagle import EagleProposer
from shared.spec.eagle_head import EagleHead, EagleHeadConfig
from shared.spec.proposer import ProposalInput

CONFIG = EagleHeadConfig(
    hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=50
)


def make_head(seed: int = 0) -> EagleHead:
    gen = torch.Generator().manual_seed(100)
    embed = torch.randn(CONFIG.vocab_size, CONFIG.hidden_size, generator=gen)
    return EagleHead(CONFIG, embed, embed, generator=torch.Generator().manual_seed(seed))


def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, CONFIG.hidden_size, generator=gen), torch.randint(
        0, CONFIG.vocab_size, (n,), generator=gen
    )


def test_forward_shapes_and_shared_lm_head() -> None:
    head = make_head()
    hidden, ids = inputs(7)
    with torch.no_grad():
        next_hidden, logits = head(hidden, ids)
    assert next_hidden.shape == (7, CONFIG.hidden_size) and logits.shape == (7, CONFIG.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    torch.testing.assert_close(logits, next_hidden @ head.lm_head.T)
    # the target's tensors are shared, not registered: nothing of theirs is trained or saved
    names = set(head.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert "fc.weight" in names and head.fc.weight.shape == (CONFIG.hidden_size, 2 * CONFIG.hidden_size)


def test_causal_over_rows_and_positions_matter() -> None:
    head = make_head()
    hidden, ids = inputs(6)
    with torch.no_grad():
        _, a = head(hidden, ids)
        ids2 = ids.clone()
        ids2[-1] = (ids2[-1] + 1) % CONFIG.vocab_size
        _, b = head(hidden, ids2)
        _, shifted = head(hidden, ids, positions=torch.arange(10, 16))
        _, gapped = head(hidden, ids, positions=torch.tensor([0, 2, 3, 7, 8, 12]))
    torch.testing.assert_close(a[:-1], b[:-1])  # later rows never leak into earlier ones
    assert not torch.allclose(a[-1], b[-1])
    # RoPE sees relative positions: a uniform shift changes nothing, gaps do (row 0 sees only itself)
    torch.testing.assert_close(a, shifted, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a[1:], gapped[1:], atol=1e-4, rtol=1e-4)


def test_seeded_init_is_reproducible_and_trainable() -> None:
    a, b = make_head(seed=3), make_head(seed=3)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    hidden, ids = inputs(5)
    _, logits = a(hidden, ids)
    torch.nn.functional.cross_entropy(logits, ids).backward()
    assert a.fc.weight.grad is not None and a.down_proj.weight.grad is not None
    assert not a.embed.requires_grad and a.embed.grad is None


def test_save_load_round_trip(tmp_path: Path) -> None:
    head = make_head(seed=5)
    path = tmp_path / "eagle.safetensors"
    head.save(path)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(head.state_dict())
    loaded = EagleHead.load(path, head.embed, head.lm_head)
    assert loaded.config == CONFIG
    hidden, ids = inputs(4)
    with torch.no_grad():
        for x, y in zip(head(hidden, ids), loaded(hidden, ids), strict=True):
            assert torch.equal(x, y)


def test_load_rejects_foreign_files_and_wrong_target(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    foreign = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    head = make_head()
    with pytest.raises(ConfigError, match="not an EAGLE head"):
        EagleHead.load(foreign, head.embed, head.lm_head)
    path = tmp_path / "eagle.safetensors"
    head.save(path)
    small = torch.zeros(CONFIG.vocab_size - 1, CONFIG.hidden_size)
    with pytest.raises(ConfigError, match="embed"):
        EagleHead.load(path, small, small)


def test_config_from_target_spec() -> None:
    spec = DecoderSpec(
        model_type="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=40, rms_eps=1e-5, attn_scale=0.25, layer_sliding_window=(None, None),
        layer_rope_theta=(10000.0, 10000.0), max_positions=512,
    )  # fmt: skip
    config = EagleHeadConfig.from_decoder_spec(spec)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.vocab_size) == (
        spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.vocab_size,
    )  # fmt: skip
    embed = torch.randn(spec.vocab_size, spec.hidden_size)
    head = EagleHead(config, embed, embed)
    with torch.no_grad():
        _, logits = head(torch.randn(3, spec.hidden_size), torch.tensor([1, 2, 3]))
    assert logits.shape == (3, spec.vocab_size)


def make_sharp_head() -> EagleHead:
    """A random head whose attention matters: at the init scale (std 0.02) the residual stream swamps it, and
    a head attending to the wrong rows would draft the same tokens."""
    head = make_head().eval()
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(15.0)
        head.q_proj.weight.mul_(3.0)  # sharp attention: a key's position shows in the drafts
        head.k_proj.weight.mul_(3.0)
    return head


def _random_windows(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    windows = []
    for n, start in ((5, 10), (1, 3), (9, 0), (2, 40)):
        hidden = torch.randn(n, CONFIG.hidden_size, generator=gen)
        windows.append((hidden, torch.randint(0, CONFIG.vocab_size, (n,), generator=gen), torch.arange(start, start + n)))
    return windows


def test_last_row_alone_equals_the_whole_window() -> None:
    """Drafting runs the layer for each window's last row only, over the keys and values of its rows
    (padded windows of lengths 1 to 9, positions offset per window): the window's full forward's last row."""
    head = make_sharp_head()
    head.pack_for_inference()
    windows = _random_windows(torch.Generator().manual_seed(3))
    lengths = torch.tensor([w[0].shape[0] for w in windows])
    hidden, ids, positions = (pad_sequence([w[k] for w in windows], batch_first=True) for k in range(3))
    x, k, v = head.draft_rows(hidden, ids, positions)
    last = torch.arange(len(windows)), lengths - 1
    key_mask = torch.arange(hidden.shape[1])[None, :] < lengths[:, None]
    out = head.attend_last(x[last], positions[last], k, v, key_mask)
    with torch.no_grad():
        alone = torch.cat([head.forward_hidden(*w)[-1:] for w in windows])
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)


def test_drafts_equal_rerunning_the_window_for_every_draft() -> None:
    """The proposer's drafts (one row added per draft) are what re-running the head over the grown window
    gives, per request; requests wanting fewer drafts, none, or with no hidden states are served alongside."""
    head = make_sharp_head()
    proposer = EagleProposer(head)
    gen = torch.Generator().manual_seed(4)
    wants = (6, 1, 0, 4)
    requests = []
    for (hidden, _, _), want in zip(_random_windows(gen), wants, strict=True):
        tokens = torch.randint(0, CONFIG.vocab_size, (hidden.shape[0] + 7,), generator=gen).tolist()
        requests.append(ProposalInput(f"r{len(requests)}", tokens, want, hidden))
    requests.append(ProposalInput("no-hidden", [1, 2, 3], 3, None))
    drafts = proposer.propose(requests)
    assert [len(d) for d in drafts] == [*wants, 0]
    with torch.no_grad():
        for r, got in zip(requests[:-1], drafts, strict=False):
            assert r.hidden_states is not None
            m, length = r.hidden_states.shape[0], len(r.token_ids)
            hidden, ids = r.hidden_states, torch.tensor(r.token_ids[length - m :])
            positions = torch.arange(length - m, length)
            expected = []
            for _ in range(r.num_speculative_tokens):
                new = head.forward_hidden(hidden, ids, positions)[-1:]
                token = int((new @ head.lm_head.T).argmax())
                expected.append(token)
                hidden, ids = torch.cat([hidden, new]), torch.cat([ids, torch.tensor([token])])
                positions = torch.cat([positions, positions[-1:] + 1])
            assert got == expected


def test_drafting_needs_packed_projections() -> None:
    head = make_head().eval()
    with pytest.raises(RuntimeError, match="pack_for_inference"):
        head.draft_rows(torch.zeros(1, 1, CONFIG.hidden_size), torch.zeros(1, 1, dtype=torch.int64),
                        torch.zeros(1, 1, dtype=torch.int64))


def test_packed_projections_match_the_modules_and_training_drops_them() -> None:
    """Serving packs q/k/v and gate/up into LinearWeights; the result must be the modules' up to fp32
    rounding, and going back to training must never leave stale packs behind."""
    head = make_head().eval()
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 6, CONFIG.hidden_size, generator=gen)
    ids = torch.randint(0, CONFIG.vocab_size, (3, 6), generator=gen)
    positions = torch.arange(6).repeat(3, 1)
    with torch.no_grad():
        plain = head.forward_hidden_batch(hidden, ids, positions)
        EagleProposer(head)  # packs
        assert head._packed is not None
        packed = head.forward_hidden_batch(hidden, ids, positions)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    head.train()
    assert head._packed is None
    with torch.no_grad():
        head.fc.weight.mul_(2.0)
        assert not torch.allclose(head.forward_hidden_batch(hidden, ids, positions), plain)


def test_tree_drafts_equal_rerunning_each_branch() -> None:
    """A tree's node i is the ranks[i]-th best guess of the head re-run over the window plus node i's
    branch (each node's predicted state and token), for requests drafting trees and chains side by side."""
    from shared.spec.tree import DraftTree

    head = make_sharp_head()
    proposer = EagleProposer(head)
    tree = DraftTree.parse("0;1;2;0.0;0.1;1.0;0.0.0;0.0.0.0")
    gen = torch.Generator().manual_seed(5)
    requests = []
    for i, (hidden, _, _) in enumerate(_random_windows(gen)):
        tokens = torch.randint(0, CONFIG.vocab_size, (hidden.shape[0] + 7,), generator=gen).tolist()
        requests.append(ProposalInput(f"r{i}", tokens, tree.num_drafts if i != 1 else 2, hidden,
                                      tree if i != 1 else None))
    drafts = proposer.propose(requests)
    assert [len(d) for d in drafts] == [tree.num_drafts, 2, tree.num_drafts, tree.num_drafts]
    with torch.no_grad():
        for r, got in zip(requests, drafts, strict=True):
            if r.tree is None:
                continue
            assert r.hidden_states is not None
            m, length = r.hidden_states.shape[0], len(r.token_ids)
            # per node: (hidden rows, token ids, positions) of the sequence its children are drafted from
            seqs = {0: (r.hidden_states, torch.tensor(r.token_ids[length - m :]), torch.arange(length - m, length))}
            for node in range(1, tree.num_drafts + 1):
                hidden, ids, positions = seqs[tree.parents[node]]
                new = head.forward_hidden(hidden, ids, positions)[-1:]
                ranked = (new @ head.lm_head.T)[0].argsort(descending=True)
                token = int(ranked[tree.ranks[node]])
                assert got[node - 1] == token, (r.request_id, node)
                seqs[node] = (torch.cat([hidden, new]), torch.cat([ids, torch.tensor([token])]),
                              torch.cat([positions, positions[-1:] + 1]))
