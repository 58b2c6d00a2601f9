"""Gemma 4 assistant proposer: drafts from the target's hidden states and the target's own KV cache.

For a request with known tokens t_0 .. t_{L-1} (t_{L-1} not run by the target
yet), the target's cache holds positions 0 .. L-2 and the speculator holds its
final-norm hidden state of position L-2 (from verification, or for the prompt
from the prefill engine's handoff, as for the EAGLE head). Every request of a
batch drafts together, one assistant step per draft::

    step 0: (t_{L-1}, h_{L-2})  -> d_0, h'_0        all at position P = L - 1, over the target's
    step j: (d_{j-1}, h'_{j-1}) -> d_j, h'_j        keys of positions < P (shared/models/gemma4/assistant.py)

The assistant reads the target's store layers (the last stored layer of each
type) through the request's block tables in the layer group of each; nothing
is kept between steps. Drafts are argmaxes: verification keeps sampled and
greedy output exact either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shared.errors import ConfigError
from shared.models.gemma4.assistant import Gemma4Assistant, TargetLayerKV
from shared.ops.attention import AttentionMetadata
from shared.ops.host_copy import to_device
from shared.spec.proposer import ProposalInput

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig
    from shared.engine.kv_manager import KVCacheManager
    from shared.kv.layout import KVLayout
    from shared.models.loader import LoadedModel

__all__ = ["AssistantProposer", "build_assistant_proposer"]


class AssistantProposer:
    """Drafts with a `Gemma4Assistant` over the target's cache; see the module docstring."""

    uses_hidden_states = True

    def __init__(self, assistant: Gemma4Assistant, target: Any) -> None:
        """`target`: the engine's Gemma4TextLM (its store layers, and how a K=V layer's keys follow)."""
        self.assistant = assistant
        self.target = target
        self.store_layers = target.store_layers()
        missing = assistant.layer_types - set(self.store_layers)
        if missing:
            raise ConfigError(f"the assistant has {sorted(missing)} layers the target has no stored layer of")
        self._cache: Any = None  # the target's per-layer (keys, values) views, bound by the engine
        self._kv: KVCacheManager | None = None
        self._layout: KVLayout | None = None

    def bind_target(self, model_cache: Any, kv: KVCacheManager, layout: KVLayout) -> None:
        """The engine's cache, its block tables and its layout (called once, after the engine is built)."""
        self._cache, self._kv, self._layout = model_cache, kv, layout

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.num_speculative_tokens > 0 and r.hidden_states is not None
                and r.hidden_states.shape[0] > 0 and len(r.token_ids) >= 2]
        if not live:
            return drafts
        assert self._kv is not None and self._layout is not None, "bind_target first"
        device = self.target.device
        rows = [requests[i] for i in live]
        tokens = torch.tensor([int(r.token_ids[-1]) for r in rows], dtype=torch.int64, device=device)
        hidden = torch.stack([r.hidden_states[-1] for r in rows]).to(device)  # type: ignore[index]
        positions = torch.tensor([len(r.token_ids) - 1 for r in rows], dtype=torch.int64, device=device)
        target_kv = self._target_kv(rows, positions)
        steps = max(r.num_speculative_tokens for r in rows)
        drafted = []
        for _ in range(steps):
            tokens, hidden = self.assistant.step(tokens, hidden, positions, target_kv)
            drafted.append(tokens)
        table = torch.stack(drafted, dim=1).tolist()  # one read back for every draft
        for n, (i, r) in enumerate(zip(live, rows, strict=True)):
            drafts[i] = table[n][: r.num_speculative_tokens]
        return drafts

    def _target_kv(self, rows: Sequence[ProposalInput], positions: torch.Tensor) -> dict[str, TargetLayerKV]:
        """Each store layer's cache and metadata for these rows: keys of positions < P, queries at P."""
        assert self._kv is not None and self._layout is not None
        device = positions.device
        seq_lens = [len(r.token_ids) - 1 for r in rows]
        metas: dict[int, AttentionMetadata] = {}
        out = {}
        for layer_type, layer in self.store_layers.items():
            group = self._layout.group_of(layer)
            if group not in metas:
                tables = [self._kv.tables(r.request_id)[group] for r in rows]
                padded = torch.zeros((len(tables), max(len(t) for t in tables)), dtype=torch.int32)
                for n, t in enumerate(tables):
                    padded[n, : len(t)] = torch.tensor(t, dtype=torch.int32)
                metas[group] = AttentionMetadata(
                    slot_mapping=torch.zeros(len(rows), dtype=torch.int64, device=device),
                    query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
                    seq_lens=to_device(seq_lens, dtype=torch.int32, device=device),
                    block_tables=padded.to(device), query_lens_host=[1] * len(rows), seq_lens_host=seq_lens,
                    positions=positions - 1)
            k_cache, v_cache = self._cache[layer] if not isinstance(self._cache, torch.Tensor) else (
                self._cache[layer, :, 0], self._cache[layer, :, 1])
            out[layer_type] = TargetLayerKV(k_cache, v_cache, metas[group], self.target.keys_from_values(layer))
        return out


def build_assistant_proposer(config: EngineConfig, loaded: LoadedModel) -> AssistantProposer:
    from shared.models.gemma4 import Gemma4TextLM

    if config.spec_draft_model is None:
        raise ConfigError("spec method 'gemma4_assistant' needs spec_draft_model: the assistant's HF directory")
    if not isinstance(loaded.model, Gemma4TextLM):
        raise ConfigError(f"a gemma4_assistant drafts for Gemma 4 targets, not {loaded.spec.model_type}")
    target = loaded.model
    assistant = Gemma4Assistant(Path(config.spec_draft_model).expanduser(), target.w.embed, target.attention,
                                loaded.spec.max_positions, target.dtype)
    return AssistantProposer(assistant, target)
