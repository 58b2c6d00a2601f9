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

Trees (`ProposalInput.tree`, shared/spec/tree.py) draft level by level: the
query rows of one depth's parents run as one `attend_last` batch, each row
seeing the window and its own branch's rows (a mask per row), and a parent's
children are its top guesses, ranks as the tree names them. A chain's
drafting is the same walk with one parent per level, kept as its own loop
because it needs no masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from shared.errors import ConfigError
from shared.ops.linear import LinearWeight
from shared.spec.eagle_head import EagleHead
from shared.spec.proposer import ProposalInput
from shared.spec.tree import DraftTree

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig
    from shared.models.decoder import DecoderLM
    from shared.models.loader import LoadedModel

__all__ = ["EagleProposer", "build_eagle_proposer", "target_lm_head"]


class EagleProposer:
    """Drafts with an `EagleHead`; see the module docstring."""

    uses_hidden_states = True
    drafts_trees = True

    def __init__(self, head: EagleHead) -> None:
        self.head = head.eval()
        head.pack_for_inference()
        ids = head.draft_token_ids
        weight = head.lm_head if ids is None else head.lm_head.index_select(0, ids)
        self._scores = LinearWeight(weight.contiguous())  # [draft_vocab, hidden]
        self._ids = ids

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests)
                if r.num_speculative_tokens > 0 and r.hidden_states is not None and r.hidden_states.shape[0] > 0]
        chains = [i for i in live if requests[i].tree is None]
        if chains:
            for i, row in zip(chains, self._draft_chains([requests[i] for i in chains]), strict=True):
                drafts[i] = row
        trees: dict[DraftTree, list[int]] = {}
        for i in live:
            tree = requests[i].tree
            if tree is not None:
                trees.setdefault(tree, []).append(i)
        for tree, group in trees.items():
            for i, row in zip(group, self._draft_tree([requests[i] for i in group], tree), strict=True):
                drafts[i] = row[: requests[i].num_speculative_tokens]
        return drafts

    def _windows(self, requests: Sequence[ProposalInput]) -> _Windows:
        """Every request's window rows at once, padded to the longest; padding is never attended to."""
        device, dtype = self.head.embed.device, self.head.embed.dtype
        windows = []
        for r in requests:
            assert r.hidden_states is not None
            m, length = r.hidden_states.shape[0], len(r.token_ids)
            tokens = torch.tensor([int(t) for t in r.token_ids[length - m :]], dtype=torch.int64, device=device)
            windows.append((r.hidden_states.to(device, dtype), tokens, torch.arange(length - m, length, device=device)))
        lengths = torch.tensor([w[0].shape[0] for w in windows], device=device)
        hidden, tokens, positions = (pad_sequence([w[k] for w in windows], batch_first=True) for k in range(3))
        x, k, v = self.head.draft_rows(hidden, tokens, positions)
        last = torch.arange(len(requests), device=device), lengths - 1
        key_mask = torch.arange(hidden.shape[1], device=device)[None, :] < lengths[:, None]
        return _Windows(x[last], positions[last], k, v, key_mask)

    def _guess(self, new_hidden: torch.Tensor, num: int = 1) -> torch.Tensor:  # [rows, num] token ids
        scores = self._scores(new_hidden)
        best = scores.argmax(dim=-1, keepdim=True) if num == 1 else scores.topk(num, dim=-1).indices
        return best if self._ids is None else self._ids[best]

    def _draft_chains(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        w = self._windows(requests)
        x, positions, k, v, key_mask = w.x, w.positions, w.k, w.v, w.key_mask
        steps = max(r.num_speculative_tokens for r in requests)
        drafted = []  # [len(requests)] token ids per draft position, read back once at the end
        for j in range(steps):
            new_hidden = self.head.attend_last(x, positions, k, v, key_mask)  # [len(requests), hidden]
            token_ids = self._guess(new_hidden)[:, 0]
            drafted.append(token_ids)
            if j + 1 == steps:
                break
            # the draft's own row (its predicted state, its token) joins each window; windows that are done
            # drafting compute it too and ignore it (one batched call, not a gather of the active ones)
            positions = positions + 1
            x_new, k_new, v_new = self.head.draft_rows(new_hidden[:, None], token_ids[:, None], positions[:, None])
            x, k, v = x_new[:, 0], torch.cat([k, k_new], dim=1), torch.cat([v, v_new], dim=1)
            key_mask = torch.cat([key_mask, key_mask.new_ones(len(requests), 1)], dim=1)
        return [row[: r.num_speculative_tokens]
                for r, row in zip(requests, torch.stack(drafted, dim=1).tolist(), strict=True)]

    def _draft_tree(self, requests: Sequence[ProposalInput], tree: DraftTree) -> list[list[int]]:
        """Every node's token, nodes 1..n in order, per request (see the module docstring)."""
        w = self._windows(requests)
        b, device = len(requests), w.x.device
        ancestors = tree.ancestor_mask(device)[:, 1:]  # [n + 1, n]: which nodes' rows a node's query sees
        rows_x = [w.x]  # per node: its row's residual stream [b, hidden] (node 0: the window's last row)
        keys, values = [w.k], [w.v]  # the window's, then node rows' [b, 1, kv_heads, head_dim] in node order
        tokens: list[torch.Tensor | None] = [None] * (tree.num_drafts + 1)
        for depth in range(tree.max_depth):
            parents = [p for p in range(len(tree.parents)) if tree.depths[p] == depth and tree.children(p)]
            num_p, num_nodes = len(parents), len(keys) - 1  # node rows so far: nodes 1 .. num_nodes
            k, v = torch.cat(keys, dim=1), torch.cat(values, dim=1)  # [b, window + num_nodes, ...]
            sees_nodes = ancestors[parents, :num_nodes]  # [num_p, num_nodes]
            key_mask = torch.cat([w.key_mask[:, None].expand(-1, num_p, -1), sees_nodes.expand(b, -1, -1)], dim=2)
            # one query row per (request, parent), request-major: each request's rows repeat per parent
            query = torch.stack([rows_x[p] for p in parents], dim=1).reshape(b * num_p, -1)
            new_hidden = self.head.attend_last(query, (w.positions + depth).repeat_interleave(num_p),
                                               k.repeat_interleave(num_p, dim=0), v.repeat_interleave(num_p, dim=0),
                                               key_mask.reshape(b * num_p, -1))
            children = [(c, n) for n, p in enumerate(parents) for c in tree.children(p)]
            guesses = self._guess(new_hidden, 1 + max(tree.ranks[c] for c, _ in children)).view(b, num_p, -1)
            child_ids = torch.stack([guesses[:, n, tree.ranks[c]] for c, n in children], dim=1)  # [b, num_c]
            for j, (c, _) in enumerate(children):
                tokens[c] = child_ids[:, j]
            if depth + 1 == tree.max_depth:
                break
            # the children's rows: their parent's predicted state and their own token, at depth + 1
            child_hidden = new_hidden.view(b, num_p, -1)[:, [n for _, n in children]]
            child_pos = (w.positions + depth + 1)[:, None].expand(-1, len(children))
            x, k_new, v_new = self.head.draft_rows(child_hidden, child_ids, child_pos)
            rows_x.extend(x[:, j] for j in range(len(children)))
            keys.extend(k_new[:, j : j + 1] for j in range(len(children)))
            values.extend(v_new[:, j : j + 1] for j in range(len(children)))
        return torch.stack(tokens[1:], dim=1).tolist()  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Windows:
    """The window rows of a batch of requests, as `EagleHead.draft_rows` left them."""

    x: torch.Tensor  # [b, hidden] each window's last row (the query that drafts the first token)
    positions: torch.Tensor  # [b] its position (of t_{L-1})
    k: torch.Tensor  # [b, rows, kv_heads, head_dim], padded
    v: torch.Tensor
    key_mask: torch.Tensor  # [b, rows] True on real rows


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
