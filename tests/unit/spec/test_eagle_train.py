"""Multi-step EAGLE training: the batched, masked forward of every draft step equals chained drafting."""

from __future__ import annotations

import torch

from shared.spec.eagle_head import EagleHead, EagleHeadConfig
from shared.spec.eagle_train import TrainingSequence, _chain_mask, chain_predictions

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
