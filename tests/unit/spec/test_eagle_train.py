"""Multi-step EAGLE training: the batched, masked forward of every draft step equals chained drafting."""

from __future__ import annotations

import torch

from shared.spec.eagle_head import EagleHead, EagleHeadConfig
from shared.spec.eagle_train import (
    STEP_DECAY,
    TrainingSequence,
    _batch_loss,
    _chain_mask,
    _Corpus,
    chain_predictions,
    load_training_data,
    save_training_data,
)

CONFIG = EagleHeadConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                         vocab_size=50, max_positions=64)


def make_head(seed: int = 0) -> EagleHead:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(CONFIG.vocab_size, CONFIG.hidden_size, generator=gen)
    return EagleHead(CONFIG, embed, embed, generator=gen, draft_token_ids=torch.arange(40)).eval()


def make_sequence(n: int, seed: int = 1) -> TrainingSequence:
    gen = torch.Generator().manual_seed(seed)
    return TrainingSequence(torch.randint(CONFIG.vocab_size, (n,), generator=gen),
                            torch.randn(n, CONFIG.hidden_size, generator=gen),
                            torch.randint(CONFIG.vocab_size, (n,), generator=gen))


def test_chain_mask_sees_real_rows_up_to_its_own_and_its_own_steps() -> None:
    mask = _chain_mask(3, 3, torch.device("cpu")).int()
    expected = torch.tensor([
        # step 0 (real rows): causal      step 1            step 2
        [1, 0, 0,                         0, 0, 0,          0, 0, 0],
        [1, 1, 0,                         0, 0, 0,          0, 0, 0],
        [1, 1, 1,                         0, 0, 0,          0, 0, 0],
        [1, 0, 0,                         1, 0, 0,          0, 0, 0],
        [1, 1, 0,                         0, 1, 0,          0, 0, 0],
        [1, 1, 1,                         0, 0, 1,          0, 0, 0],
        [1, 0, 0,                         1, 0, 0,          1, 0, 0],
        [1, 1, 0,                         0, 1, 0,          0, 1, 0],
        [1, 1, 1,                         0, 0, 1,          0, 0, 1],
    ])  # fmt: skip
    assert torch.equal(mask, expected)


@torch.no_grad()
def test_training_steps_equal_chained_drafting() -> None:
    """Step k of row r, trained in one masked forward, is what serving computes: the window's real rows up to
    r, then the head's own predictions fed back one row at a time (with the true next tokens)."""
    head, seq = make_head(), make_sequence(12)
    start, width, depth = 2, 6, 3
    rows = torch.arange(start, start + width)
    preds = chain_predictions(head, seq, rows, depth)
    for i, r in enumerate(rows.tolist()):
        real = torch.arange(start, r + 1)
        hidden, tokens, positions = seq.hidden_states[real], seq.token_ids[real + 1], real + 1
        for k in range(depth):
            out = head.forward_hidden(hidden, tokens, positions)[-1:]
            torch.testing.assert_close(preds[k][i : i + 1], out, atol=1e-5, rtol=1e-5)
            nxt = min(r + k + 2, seq.token_ids.shape[0] - 1)
            hidden = torch.cat([hidden, out])
            tokens = torch.cat([tokens, seq.token_ids[nxt : nxt + 1]])
            positions = torch.cat([positions, positions[-1:] + 1])


def _window_loss_reference(head: EagleHead, lm_rows: torch.Tensor, to_draft: torch.Tensor, seq: TrainingSequence,
                           start: int, width: int, ce_weight: float, depth: int) -> tuple[torch.Tensor, int, int]:
    """One window's loss written out row by row from chain_predictions: the window ends where the sequence
    does, a step whose targets all lie past the end is left out."""
    n = seq.token_ids.shape[0]
    rows = torch.arange(start, min(start + width, n - 1))
    total, correct, labelled = torch.zeros(()), 0, 0
    for k, pred in enumerate(chain_predictions(head, seq, rows, min(depth, n - 1 - start))):
        inside = rows + k + 1 < n
        target = (rows + k + 1)[inside]
        reg = torch.nn.functional.smooth_l1_loss(pred[inside], seq.hidden_states[target])
        labels = to_draft[seq.greedy_next[target]]
        logits = pred[inside] @ lm_rows.T
        valid = labels >= 0
        ce = torch.nn.functional.cross_entropy(logits[valid], labels[valid]) if valid.any() else torch.zeros(())
        total = total + STEP_DECAY**k * (reg + ce_weight * ce)
        if k == 0:
            correct, labelled = int((logits.argmax(-1)[valid] == labels[valid]).sum()), int(valid.sum())
    return total, correct, labelled


@torch.no_grad()
def test_a_batch_of_windows_is_the_mean_of_each_window_alone() -> None:
    """Windows of different sequences, cut short by their sequence's end (padding rows, draft steps with no
    target left), in one batched forward: the loss is the mean of each window's own, the counts their sums."""
    head = make_head()
    sequences = [make_sequence(n, seed=n) for n in (12, 5, 9, 3)]
    draft_ids = head.draft_token_ids
    assert draft_ids is not None
    lm_rows = head.lm_head.index_select(0, draft_ids)
    to_draft = torch.full((CONFIG.vocab_size,), -100, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(draft_ids.shape[0])
    corpus = _Corpus(sequences, torch.device("cpu"))
    windows = [(0, 2), (1, 0), (2, 3), (0, 9), (3, 0), (2, 6), (0, 10)]  # (sequence, start)
    width, depth, ce_weight = 6, 3, 0.3
    seq = torch.tensor([s for s, _ in windows])
    start = torch.tensor([r for _, r in windows])
    loss, correct, labelled = _batch_loss(head, lm_rows, to_draft, corpus, seq, start, width, ce_weight, depth)
    expected = [_window_loss_reference(head, lm_rows, to_draft, sequences[s], r, width, ce_weight, depth)
                for s, r in windows]
    torch.testing.assert_close(loss, torch.stack([e[0] for e in expected]).mean(), atol=1e-5, rtol=1e-5)
    assert (int(correct), int(labelled)) == (sum(e[1] for e in expected), sum(e[2] for e in expected))


def test_training_data_round_trips_through_the_cache_file(tmp_path) -> None:
    sequences = [make_sequence(n, seed=n) for n in (5, 9)]
    save_training_data(sequences, tmp_path / "data.pt")
    for limit, expected in ((None, sequences), (1, sequences[:1])):
        loaded = load_training_data(tmp_path / "data.pt", limit)
        assert len(loaded) == len(expected)
        for got, want in zip(loaded, expected, strict=True):
            assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.greedy_next, want.greedy_next)
            assert torch.equal(got.hidden_states, want.hidden_states)
