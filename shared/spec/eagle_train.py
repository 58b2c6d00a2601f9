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
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.spec.eagle_head import EagleHead

logger = logging.getLogger(__name__)

__all__ = ["TrainingSequence", "chain_predictions", "draft_vocabulary", "extract_hidden_states", "generate_sequences",
           "load_training_data", "save_training_data", "train_head"]

_IGNORE = -100
STEP_DECAY = 0.8  # weight of draft step k's loss: STEP_DECAY ** k


@dataclass
class TrainingSequence:
    token_ids: torch.Tensor  # [n] int64
    hidden_states: torch.Tensor  # [n, hidden]: the target's final-norm hidden state at each position
    greedy_next: torch.Tensor  # [n] int64: the target's argmax after each position


def save_training_data(sequences: Sequence[TrainingSequence], path: str | Path) -> None:
    """train-draft's `--data-cache`: the generated text, hidden states and labels, for a later run to reuse."""
    torch.save([{"token_ids": s.token_ids, "hidden_states": s.hidden_states, "greedy_next": s.greedy_next}
                for s in sequences], path)


def load_training_data(path: str | Path, limit: int | None = None) -> list[TrainingSequence]:
    """What `save_training_data` wrote (the first `limit` sequences, if given)."""
    return [TrainingSequence(r["token_ids"], r["hidden_states"], r["greedy_next"])
            for r in torch.load(path)[:limit]]


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


def _chain_batch(
    head: EagleHead,
    hidden: torch.Tensor,  # [b, w, hidden] the target's states at rows r
    tokens: torch.Tensor,  # [b, w, depth] the token after the one each step k predicts: t_{r + k + 1}
    positions: torch.Tensor,  # [b, w] r + 1
    depth: int,
) -> list[torch.Tensor]:  # per step k: [b, w, hidden], row r's prediction of the state at r + k + 1
    """Every draft step of b windows at once: step k's input is step k - 1's prediction (see the module
    docstring), all steps in one masked forward per k. Rows past a window's end only ever see themselves and
    real rows before them, so padding changes no real row's prediction."""
    b, w = positions.shape
    hidden_in, preds = [hidden], []
    for k in range(depth):
        mask = _chain_mask(w, k + 1, hidden.device).expand(b, -1, -1) if k else None
        token_in = tokens[:, :, : k + 1].transpose(1, 2).reshape(b, -1)  # steps 0 .. k, each w rows
        pos_in = torch.cat([positions + j for j in range(k + 1)], dim=1)
        pred = head.forward_hidden_batch(torch.cat(hidden_in, dim=1), token_in, pos_in, mask)[:, k * w :]
        preds.append(pred)
        hidden_in.append(pred)
    return preds


def chain_predictions(head: EagleHead, seq: TrainingSequence, rows: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The head's predicted hidden states [len(rows), hidden] for each draft step k < depth: step k's row r
    predicts the state at position r + k + 1 (rows past the sequence's end hold padding; mask them)."""
    n = seq.token_ids.shape[0]
    steps = torch.arange(depth, device=rows.device)
    tokens = seq.token_ids[(rows[:, None] + steps + 1).clamp(max=n - 1)]
    preds = _chain_batch(head, seq.hidden_states[rows][None], tokens[None], (rows + 1)[None], depth)
    return [p[0] for p in preds]


class _Corpus:
    """Every usable training sequence's rows in flat tensors on the training device, so that a batch of
    windows is gathered with one index per tensor instead of a Python loop over sequences."""

    def __init__(self, sequences: Sequence[TrainingSequence], device: torch.device) -> None:
        usable = [s for s in sequences if s.token_ids.shape[0] >= 3]
        lengths = [s.token_ids.shape[0] for s in usable]
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
        self.offsets = torch.tensor([0, *lengths[:-1]], dtype=torch.int64, device=device).cumsum(0)
        self.hidden = torch.cat([s.hidden_states for s in usable]).to(device)
        self.tokens = torch.cat([s.token_ids for s in usable]).to(device)
        self.greedy_next = torch.cat([s.greedy_next for s in usable]).to(device)

    def __len__(self) -> int:
        return self.lengths.shape[0]


def _batch_loss(
    head: EagleHead, lm_rows: torch.Tensor, to_draft: torch.Tensor, corpus: _Corpus, seq: torch.Tensor,
    start: torch.Tensor, width: int, ce_weight: float, depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean over b windows (sequence `seq[i]`, rows start[i] .. start[i] + width - 1, as far as the sequence
    goes) of each window's loss: per draft step k, smooth L1 on the predicted state plus `ce_weight` x
    cross-entropy on the target's greedy token, each averaged over the window's rows whose target exists,
    weighed STEP_DECAY ** k. Also (correct top-1 first drafts, labelled rows), as device scalars."""
    device = start.device
    n = corpus.lengths[seq][:, None]  # [b, 1]
    base = corpus.offsets[seq][:, None]
    rows = start[:, None] + torch.arange(width, device=device)  # [b, w]
    steps = torch.arange(depth, device=device)
    # t_{r + k + 1} for each step k, clamped to the sequence's last token (past it only padding rows read it)
    tokens = corpus.tokens[base[..., None] + torch.minimum(rows[..., None] + steps + 1, n[..., None] - 1)]
    hidden = corpus.hidden[base + torch.minimum(rows, n - 1)]
    preds = _chain_batch(head, hidden, tokens, rows + 1, depth)
    total = hidden.new_zeros(())
    correct = labelled = hidden.new_zeros((), dtype=torch.int64)
    for k, pred in enumerate(preds):
        target = rows + k + 1  # the position whose state step k predicts
        inside = (target < n).float()  # [b, w]
        count = inside.sum(dim=1).clamp(min=1)
        target_flat = base + torch.minimum(target, n - 1)
        reg = F.smooth_l1_loss(pred, corpus.hidden[target_flat], reduction="none").mean(dim=-1)
        labels = to_draft[corpus.greedy_next[target_flat]]  # _IGNORE outside the draft vocabulary
        labelled_rows = inside * (labels != _IGNORE)
        logits = pred @ lm_rows.T  # [b, w, draft_vocab]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none").view_as(reg)
        per_window = (reg * inside).sum(dim=1) / count
        per_window = per_window + ce_weight * (ce * labelled_rows).sum(dim=1) / labelled_rows.sum(dim=1).clamp(min=1)
        total = total + STEP_DECAY**k * per_window.mean()
        if k == 0:
            hit = (logits.argmax(dim=-1) == labels) & (labelled_rows > 0)
            correct, labelled = hit.sum(), (labelled_rows > 0).sum()
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
    """AdamW with one-cycle decay over random windows, a batch of them per step, each drafted `depth` steps deep
    (on the head's device); returns the first draft's teacher-forced top-1 accuracy over the last 10% of steps."""
    assert head.draft_token_ids is not None, "give the head a draft vocabulary (draft_vocabulary())"
    device = head.fc.weight.device
    gen = torch.Generator().manual_seed(seed)
    lm_rows = head.lm_head.index_select(0, head.draft_token_ids).detach()  # [draft_vocab, hidden]
    to_draft = torch.full((head.config.vocab_size,), _IGNORE, dtype=torch.int64, device=device)
    to_draft[head.draft_token_ids] = torch.arange(head.draft_token_ids.shape[0], device=device)
    corpus = _Corpus(sequences, device)
    lengths = corpus.lengths.cpu()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    head.train()
    correct_tail = labelled_tail = 0
    for step in range(steps):
        opt.zero_grad()
        seq = torch.randint(len(corpus), (batch_windows,), generator=gen)
        # a start where the whole window fits when the sequence is long enough, else 0
        room = (lengths[seq] - 1 - window).clamp(min=0) + 1
        start = (torch.rand(batch_windows, generator=gen) * room).long()
        loss, correct, labelled = _batch_loss(head, lm_rows, to_draft, corpus, seq.to(device), start.to(device),
                                              window, ce_weight, depth)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if progress is not None or step >= steps * 9 // 10:
            c, m = int(correct), int(labelled)  # one host sync per step: the progress bar shows them
            if step >= steps * 9 // 10:
                correct_tail, labelled_tail = correct_tail + c, labelled_tail + m
            if progress is not None:
                progress(step, loss.item(), c / max(m, 1))
    head.eval()
    return correct_tail / max(labelled_tail, 1)
