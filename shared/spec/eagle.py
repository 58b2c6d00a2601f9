"""EAGLE proposer: the draft head over the target's own hidden states.

For a request with known tokens t_0 .. t_{L-1}, the engine hands over the
target's hidden states of the last m positions it computed, L - 1 - m .. L - 2
(from the verification forwards, and for the prompt from the prefill engine's
handoff: decode never reruns the prompt through the target for them). The head
pairs each with the token after it, predicts the next hidden state, and feeds
its own prediction back for the following draft::

    rows  (h_{L-1-m}, t_{L-m}) .. (h_{L-2}, t_{L-1})       -> h'_{L-1} -> d_0
    + (h'_{L-1}, d_0)                                      -> h'_L     -> d_1  ...

Only the last row's output is ever needed, so the window's rows give just
their keys and values (`EagleHead.draft_rows`, one batched call over every
window padded to the longest) and each draft position runs the rest of the
layer for one query row per request (`EagleHead.attend_last`), then adds that
draft's own keys and values. Re-running the whole layer over the window for
every draft cost ~8x the multiply-adds (m = 16 rows, 3 drafts). Nothing is kept
between calls: the window's keys are recomputed from the target's hidden
states each step (its last rows change as drafts are rejected). Scoring is one
matrix product per draft position over the head's draft vocabulary when it has
one. Drafts are argmaxes (softcapping is monotone, so it is skipped).
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
        live = [i for i, r in enumerate(requests)
                if r.num_speculative_tokens > 0 and r.hidden_states is not None and r.hidden_states.shape[0] > 0]
        if not live:
            return drafts
        windows = []
        for i in live:
            r = requests[i]
            assert r.hidden_states is not None
            m, length = r.hidden_states.shape[0], len(r.token_ids)
            tokens = torch.tensor([int(t) for t in r.token_ids[length - m :]], dtype=torch.int64, device=device)
            windows.append((r.hidden_states.to(device, dtype), tokens, torch.arange(length - m, length, device=device)))
        # every window's rows at once, padded to the longest; padding is never attended to
        lengths = torch.tensor([w[0].shape[0] for w in windows], device=device)
        hidden, tokens, positions = (pad_sequence([w[k] for w in windows], batch_first=True) for k in range(3))
        x, k, v = self.head.draft_rows(hidden, tokens, positions)
        last = torch.arange(len(live), device=device), lengths - 1
        x, positions = x[last], positions[last]  # the query rows
        key_mask = torch.arange(hidden.shape[1], device=device)[None, :] < lengths[:, None]
        steps = max(requests[i].num_speculative_tokens for i in live)
        drafted = []  # [len(live)] token ids per draft position, read back once at the end
        for j in range(steps):
            new_hidden = self.head.attend_last(x, positions, k, v, key_mask)  # [len(live), hidden]
            best = self._scores(new_hidden).argmax(dim=-1)
            token_ids = best if self._ids is None else self._ids[best]
            drafted.append(token_ids)
            if j + 1 == steps:
                break
            # the draft's own row (its predicted state, its token) joins each window; windows that are done
            # drafting compute it too and ignore it (one batched call, not a gather of the active ones)
            positions = positions + 1
            x_new, k_new, v_new = self.head.draft_rows(new_hidden[:, None], token_ids[:, None], positions[:, None])
            x, k, v = x_new[:, 0], torch.cat([k, k_new], dim=1), torch.cat([v, v_new], dim=1)
            key_mask = torch.cat([key_mask, key_mask.new_ones(len(live), 1)], dim=1)
        for n, row in enumerate(torch.stack(drafted, dim=1).tolist()):
            drafts[live[n]] = [int(t) for t in row[: requests[live[n]].num_speculative_tokens]]
        return drafts


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
