"""EAGLE proposer: the draft head over the target's own hidden states.

For a request with known tokens t_0 .. t_{L-1}, the engine hands over the
target's hidden states of the last m positions it computed, L - 1 - m .. L - 2
(from the verification forwards, and for the prompt from the prefill engine's
handoff: decode never reruns the prompt through the target for them). The head
pairs each with the token after it, predicts the next hidden state, and feeds
its own prediction back for the following draft::

    rows  (h_{L-1-m}, t_{L-m}) .. (h_{L-2}, t_{L-1})       -> h'_{L-1} -> d_0
    + (h'_{L-1}, d_0)                                      -> h'_L     -> d_1  ...

The head keeps no KV cache: each draft re-runs its one layer over the window
(m + j rows, m <= the speculator's hidden window), which costs little next to
scoring the vocabulary. Both are batched across requests, one forward (windows
padded to the longest) and one matrix product per draft position, scoring over
the head's draft vocabulary when it has one. Drafts are argmaxes (softcapping
is monotone, so it is skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from shared.errors import ConfigError
from shared.ops.linear import LinearWeight
from shared.spec.eagle_head import EagleHead
from shared.spec.proposer import ProposalInput

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig
    from shared.models.decoder import DecoderLM
    from shared.models.loader import LoadedModel

__all__ = ["EagleProposer", "build_eagle_proposer", "target_lm_head"]


class EagleProposer:
    """Drafts with an `EagleHead`; see the module docstring."""

    uses_hidden_states = True

    def __init__(self, head: EagleHead) -> None:
        self.head = head.eval()
        head.pack_for_inference()
        ids = head.draft_token_ids
        weight = head.lm_head if ids is None else head.lm_head.index_select(0, ids)
        self._scores = LinearWeight(weight.contiguous())  # [draft_vocab, hidden]
        self._ids = ids

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        device, dtype = self.head.embed.device, self.head.embed.dtype
        drafts: list[list[int]] = [[] for _ in requests]
        rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for i, r in enumerate(requests):
            if r.num_speculative_tokens == 0 or r.hidden_states is None or r.hidden_states.shape[0] == 0:
                continue
            m, length = r.hidden_states.shape[0], len(r.token_ids)
            hidden = r.hidden_states.to(device, dtype)  # [m, hidden]
            tokens = torch.tensor([int(t) for t in r.token_ids[length - m :]], dtype=torch.int64, device=device)
            positions = torch.arange(length - m, length, device=device)
            rows[i] = (hidden, tokens, positions)
        for j in range(max((requests[i].num_speculative_tokens for i in rows), default=0)):
            active = [i for i in rows if requests[i].num_speculative_tokens > j]
            new_hidden = self._last_rows([rows[i] for i in active])  # [len(active), hidden]
            best = self._scores(new_hidden).argmax(dim=-1)  # [len(active)]
            token_ids = (best if self._ids is None else self._ids[best]).tolist()
            for n, i in enumerate(active):
                drafts[i].append(int(token_ids[n]))
                hidden, tokens, positions = rows[i]
                rows[i] = (
                    torch.cat([hidden, new_hidden[n : n + 1]]),
                    torch.cat([tokens, best.new_tensor([token_ids[n]])]),
                    torch.cat([positions, positions[-1:] + 1]),
                )
        return drafts

    def _last_rows(self, windows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The head's prediction after the last row of each (hidden, tokens, positions) window, in one forward
        over the windows padded to the longest (not a forward per request: at batch 8 the engine then idled
        41% of the time between steps, 33% batched)."""
        if len(windows) == 1:
            hidden, tokens, positions = windows[0]
            return self.head.forward_hidden(hidden, tokens, positions)[-1:]
        lengths = torch.tensor([w[0].shape[0] for w in windows], device=windows[0][0].device)
        hidden, tokens, positions = (pad_sequence([w[k] for w in windows], batch_first=True) for k in range(3))
        idx = torch.arange(hidden.shape[1], device=hidden.device)
        # causal within each window, never onto padding (a padded query row still sees key 0: no empty rows)
        mask = (idx[None, :] <= idx[:, None])[None] & (idx[None, :] < lengths[:, None])[:, None, :]
        out = self.head.forward_hidden_batch(hidden, tokens, positions, mask)  # [windows, longest, hidden]
        return out[torch.arange(len(windows), device=out.device), lengths - 1]


def target_lm_head(model: DecoderLM) -> torch.Tensor:  # [vocab, hidden]
    """The target's LM head as a plain tensor (its tied embedding on the packaged models)."""
    if model.spec.tie_word_embeddings:
        return model.embed
    if model.lm_head.backend == "torch":
        return model.lm_head.weight
    raise ConfigError("EAGLE needs the target's LM head as a plain tensor: untied heads are packed for oneDNN")


def build_eagle_proposer(config: EngineConfig, loaded: LoadedModel) -> EagleProposer:
    if config.spec_eagle_head is None:
        raise ConfigError("spec_method 'eagle' needs spec_eagle_head")
    if not config.spec_eagle_head.is_file():
        raise ConfigError(f"EAGLE head {config.spec_eagle_head} not found (make one with `baton train-draft`)")
    model = loaded.model
    return EagleProposer(EagleHead.load(config.spec_eagle_head, model.embed, target_lm_head(model)))
