"""Training an EAGLE head on the target's own text and hidden states (what `baton train-draft` runs).

    prompts ──target generates (greedy)──► sequences (prompt + reply)
    sequences ──engine in prefill role (no prefix cache)──► handoff.hidden_states [n, hidden]
    windows of rows r .. r + W - 1, drafted `depth` steps deep:
        step 0  input (h_r, t_{r+1}) at position r + 1, causal over the window's real rows
        step k  input (step k-1's prediction for row r, t_{r+k+1}) at position r + k + 1, attending to
                the real rows <= r and to row r's own earlier steps, as a chained draft does when serving
        target  h_{r+k+1} (smooth L1)  and  argmax lm_head(h_{r+k+1}) (cross-entropy over the draft vocabulary)

Training only step 0 (teacher forcing) never shows the head its own errors,
yet its second and third drafts are fed its own predictions, not the target's
states. Later steps weigh `STEP_DECAY ** k` (EAGLE-3's training-time test does
the same).

The label is the target's own greedy choice at each position (what greedy
verification compares a draft with), not the token the text happens to hold,
so sampled replies (several per prompt, for variety) teach the same thing.

The hidden states come out of the prefill path exactly as a decode engine
receives them in a handoff, so the head learns on the features it is fed when
serving. Windows match the speculator's hidden window: the head attends over
that many rows when drafting.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.spec.eagle_head import EagleHead

logger = logging.getLogger(__name__)

__all__ = ["TrainingSequence", "chain_predictions", "draft_vocabulary", "extract_hidden_states", "generate_sequences",
           "train_head"]

_IGNORE = -100
STEP_DECAY = 0.8  # weight of draft step k's loss: STEP_DECAY ** k


@dataclass
class TrainingSequence:
    token_ids: torch.Tensor  # [n] int64
    hidden_states: torch.Tensor  # [n, hidden]: the target's final-norm hidden state at each position
    greedy_next: torch.Tensor  # [n] int64: the target's argmax after each position


def generate_sequences(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int, samples_per_prompt: int = 1,
    temperature: float = 0.8,
) -> list[list[int]]:
    """Prompt + the target's own reply: one greedy, then `samples_per_prompt - 1` sampled (seeded)."""
    batch = [p for p in prompts for _ in range(samples_per_prompt)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % samples_per_prompt == 0 else temperature,
                             seed=i) for i in range(len(batch))]
    with tqdm(total=len(batch) * max_tokens, desc="generate", unit="tok", file=sys.stderr) as bar:
        results = engine.generate(batch, params, lambda out: bar.update(len(out.new_token_ids)))
    return [list(p) + r.token_ids for p, r in zip(batch, results, strict=True)]


def extract_hidden_states(
    engine: LLMEngine, sequences: Sequence[Sequence[int]], group_size: int = 16
) -> list[TrainingSequence]:
    """Hidden states of every position, from the handoffs of an engine in the prefill role.

    The engine must have prefix caching off: a cached prefix is not computed, so
    its hidden states would be missing from the handoff.
    """
    assert engine.config.role == "prefill" and not engine.config.enable_prefix_caching
    out: list[TrainingSequence] = []
    with tqdm(total=len(sequences), desc="hidden states", unit="seq", file=sys.stderr) as bar:
        for lo in range(0, len(sequences), group_size):  # groups that fit the cache: nothing is preempted
            out.extend(_extract_group(engine, sequences[lo : lo + group_size], lo))
            bar.update(len(out) - bar.n)
    return out


def _extract_group(engine: LLMEngine, sequences: Sequence[Sequence[int]], offset: int) -> list[TrainingSequence]:
    ids = [f"extract-{offset + i}" for i in range(len(sequences))]
    for request_id, seq in zip(ids, sequences, strict=True):
        # a request whose first token ends it finishes without a handoff: neither max_tokens nor eos may
        engine.add_request(request_id, seq, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    results = engine.run_to_completion()
    out = []
    for request_id, seq in zip(ids, sequences, strict=True):
        handoff = results[request_id].handoff
        assert handoff is not None and handoff.hidden_start == 0
        hidden = handoff.hidden_states.float().clone()  # a clone outside inference mode: autograd may save it
        model = engine.loaded.model
        greedy_next = model.compute_logits(hidden.to(model.device)).argmax(dim=-1).cpu()  # handoffs live on the host
        out.append(TrainingSequence(torch.tensor(list(seq), dtype=torch.int64), hidden, greedy_next.clone()))
    return out


def draft_vocabulary(sequences: Sequence[TrainingSequence], size: int) -> torch.Tensor:  # [<= size] int64
    """The `size` tokens the target most often picks greedily in the training text, ascending ids."""
    counts: Counter[int] = Counter()
    for s in sequences:
        counts.update(s.greedy_next.tolist())
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)), dtype=torch.int64)


def _chain_mask(width: int, depth: int, device: torch.device) -> torch.Tensor:
    """[depth * width]^2 bool: step k's row r sees the real rows <= r (step 0) and its own steps 1 .. k."""
    r = torch.arange(width, device=device)
    causal = r[None, :] <= r[:, None]
    same_row = torch.eye(width, dtype=torch.bool, device=device)
    blocks = [[causal if j == 0 else (same_row if j <= k else torch.zeros_like(same_row)) for j in range(depth)]
              for k in range(depth)]
    return torch.cat([torch.cat(row, dim=1) for row in blocks], dim=0)


def chain_predictions(head: EagleHead, seq: TrainingSequence, rows: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The head's predicted hidden states [len(rows), hidden] for each draft step k < depth: step k's row r
    predicts the state at position r + k + 1 (rows past the sequence's end hold padding; mask them)."""
    n, w = seq.token_ids.shape[0], rows.shape[0]
    hidden_in, token_in, pos_in = [seq.hidden_states[rows]], [seq.token_ids[rows + 1]], [rows + 1]
    preds: list[torch.Tensor] = []
    for k in range(depth):
        mask = _chain_mask(w, k + 1, rows.device) if k else None
        pred = head.forward_hidden(torch.cat(hidden_in), torch.cat(token_in), torch.cat(pos_in), mask)[k * w :]
        preds.append(pred)
        # the next step's input: this prediction, paired with the token after the one it predicts
        target_row = rows + k + 1
        hidden_in.append(pred)
        token_in.append(seq.token_ids[(target_row + 1).clamp(max=n - 1)])
        pos_in.append(target_row + 1)
    return preds


def _window_loss(
    head: EagleHead, lm_rows: torch.Tensor, to_draft: torch.Tensor, seq: TrainingSequence, start: int, width: int,
    ce_weight: float = 0.1, depth: int = 1,
) -> tuple[torch.Tensor, int, int]:
    """Loss over rows start .. start + width - 1 of `seq`, drafted `depth` steps deep; also (correct top-1
    first drafts, labelled rows)."""
    n = seq.token_ids.shape[0]
    rows = torch.arange(start, min(start + width, n - 1), device=seq.token_ids.device)
    depth = min(depth, n - 1 - start)  # a step whose every target lies past the end teaches nothing
    total = seq.hidden_states.new_zeros(())
    correct = labelled = 0
    for k, pred in enumerate(chain_predictions(head, seq, rows, depth)):
        target_row = rows + k + 1  # the position whose hidden state step k predicts
        inside = target_row < n
        safe = target_row.clamp(max=n - 1)
        reg = F.smooth_l1_loss(pred[inside], seq.hidden_states[safe][inside])
        labels = torch.where(inside, to_draft[seq.greedy_next[safe]], _IGNORE)
        logits = pred @ lm_rows.T  # [w, draft_vocab]
        valid = labels != _IGNORE
        ce = F.cross_entropy(logits, labels, ignore_index=_IGNORE) if valid.any() else logits.sum() * 0.0
        total = total + STEP_DECAY**k * (reg + ce_weight * ce)
        if k == 0:
            correct = int((logits.argmax(dim=-1)[valid] == labels[valid]).sum())
            labelled = int(valid.sum())
    return total, correct, labelled


def train_head(
    head: EagleHead,
    sequences: Sequence[TrainingSequence],
    steps: int,
    window: int = 64,
    batch_windows: int = 8,
    lr: float = 1e-3,
    progress: Callable[[int, float, float], None] | None = None,
    seed: int = 0,
    ce_weight: float = 0.1,
    depth: int = 1,
) -> float:
    """AdamW with cosine decay over random windows, each drafted `depth` steps deep (on the head's device);
    returns the first draft's teacher-forced top-1 accuracy over the last 10% of steps."""
    assert head.draft_token_ids is not None, "give the head a draft vocabulary (draft_vocabulary())"
    device = head.fc.weight.device
    gen = torch.Generator().manual_seed(seed)
    lm_rows = head.lm_head.index_select(0, head.draft_token_ids).detach()  # [draft_vocab, hidden]
    to_draft = torch.full((head.config.vocab_size,), _IGNORE, dtype=torch.int64, device=device)
    to_draft[head.draft_token_ids] = torch.arange(head.draft_token_ids.shape[0], device=device)
    usable = [TrainingSequence(s.token_ids.to(device), s.hidden_states.to(device), s.greedy_next.to(device))
              for s in sequences if s.token_ids.shape[0] >= 3]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    head.train()
    correct_tail = labelled_tail = 0
    for step in range(steps):
        opt.zero_grad()
        total = torch.zeros((), device=device)
        correct = labelled = 0
        for _ in range(batch_windows):
            seq = usable[int(torch.randint(len(usable), (1,), generator=gen))]
            n = seq.token_ids.shape[0]
            start = int(torch.randint(max(n - 1 - window, 0) + 1, (1,), generator=gen))
            loss, c, m = _window_loss(head, lm_rows, to_draft, seq, start, window, ce_weight, depth)
            total = total + loss / batch_windows
            correct, labelled = correct + c, labelled + m
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step >= steps * 9 // 10:
            correct_tail, labelled_tail = correct_tail + correct, labelled_tail + labelled
        if progress is not None:
            progress(step, total.item(), correct / max(labelled, 1))
    head.eval()
    return correct_tail / max(labelled_tail, 1)
