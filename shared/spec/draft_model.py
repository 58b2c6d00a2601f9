"""Draft-model proposer: a small model sharing the target's tokenizer drafts k tokens greedily.

The draft keeps its own paged KV cache (its own block pool and layout, sized
like the target's in tokens) so each step only runs the tokens it has not
seen, never the whole context. Per request it remembers which tokens its cache
holds; a step first rolls that back to the longest prefix still true (drafts
the target rejected are dropped), catches up on the rest, then drafts::

    draft cache:  t_0 .. t_{c-1}                       (c <= L - 1 still valid)
    forward 0:    t_c .. t_{L-1}        -> d_0          (one chunk per request, batched)
    forward j:    d_{j-1}               -> d_j          (j = 1 .. k - 1)
    afterwards:   cache holds t_0 .. t_{L-1} d_0 .. d_{k-2}

Drafts are the draft's argmax (deterministic, so verification treats them as
one-hot: exact for greedy, distribution-preserving for sampling). With no
separate draft model configured the draft is the target's own first N layers
plus its final norm and LM head (weights shared, not copied): a way to test
the machinery on any model, with modest acceptance.

A request the draft cannot hold (its pool is out of blocks) raises; the
engine then decodes that request without speculation.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shared.engine.block_pool import BlockPool
from shared.engine.request import SamplingParams
from shared.engine.runner import ModelRunner
from shared.engine.scheduler import ScheduledChunk, SchedulerPlan
from shared.errors import CapacityError, ConfigError
from shared.kv.layout import KVLayout, cdiv
from shared.models.cpu_layer_loop import CpuLayerLoop
from shared.models.decoder import DecoderLM
from shared.spec.proposer import ProposalInput

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig
    from shared.models.loader import LoadedModel

logger = logging.getLogger(__name__)

__all__ = ["DraftModelProposer", "build_draft_proposer", "truncated_model"]

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class _DraftSeq:
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds


def truncated_model(model: DecoderLM, num_layers: int) -> DecoderLM:
    """The first `num_layers` layers of `model` with its final norm and LM head (tensors shared)."""
    if not 1 <= num_layers <= model.num_layers:
        raise ConfigError(f"a truncated draft needs 1 .. {model.num_layers} layers, got {num_layers}")
    draft = copy.copy(model)
    s = model.spec
    draft.spec = dataclasses.replace(
        s, num_layers=num_layers, layer_sliding_window=s.layer_sliding_window[:num_layers],
        layer_rope_theta=s.layer_rope_theta[:num_layers],
    )
    draft.layers = model.layers[:num_layers]
    draft.num_layers = num_layers
    draft.cpu_layer_loop = CpuLayerLoop.build(draft)  # the copy's would run all of model's layers
    return draft


class DraftModelProposer:
    """Greedy drafts from a small model with its own paged KV cache (see the module docstring)."""

    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, device: str = "cpu") -> None:
        self.model = model
        layout = KVLayout(model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim,
                          model.dtype)
        self.runner = ModelRunner(model, layout, device)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self._seqs: dict[str, _DraftSeq] = {}

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.num_speculative_tokens > 0 and len(r.token_ids) > 0]
        chunks = [self._catch_up_chunk(requests[i]) for i in active]
        for j in range(max((requests[i].num_speculative_tokens for i in active), default=0)):
            next_ids = self._run(chunks)
            for i, chunk, token_id in zip(active, chunks, next_ids, strict=True):
                drafts[i].append(token_id)
                self._seqs[chunk.request_id].token_ids.extend(chunk.token_ids)
            keep = [n for n, i in enumerate(active) if requests[i].num_speculative_tokens > j + 1]
            active = [active[n] for n in keep]
            chunks = [self._next_chunk(chunks[n], drafts[active_i][-1])
                      for n, active_i in zip(keep, active, strict=True)]
        return drafts

    def _catch_up_chunk(self, request: ProposalInput) -> ScheduledChunk:
        """Roll the draft cache back to what is still true, reserve blocks, and run the rest."""
        tokens = [int(t) for t in request.token_ids]
        seq = self._seqs.setdefault(request.request_id, _DraftSeq())
        common = 0
        for a, b in zip(seq.token_ids, tokens, strict=False):
            if a != b:
                break
            common += 1
        computed = min(common, len(tokens) - 1)
        del seq.token_ids[computed:]
        # the last draft is never run, so the cache reaches L + k - 1 tokens at most
        need = cdiv(len(tokens) + request.num_speculative_tokens - 1, self.block_size) - len(seq.block_ids)
        if need > 0:
            if need > self.pool.num_free_blocks:
                raise CapacityError(f"draft KV cache full ({self.pool.num_free_blocks} blocks free, {need} needed)")
            seq.block_ids.extend(self.pool.allocate(need))
        return ScheduledChunk(request.request_id, tokens[computed:], computed, seq.block_ids, True, _GREEDY)

    @staticmethod
    def _next_chunk(chunk: ScheduledChunk, token_id: int) -> ScheduledChunk:
        return dataclasses.replace(chunk, token_ids=[token_id], start_pos=chunk.start_pos + chunk.num_tokens)

    def _run(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One draft forward over `chunks`; the argmax after each chunk's last token."""
        inputs = self.runner.prepare(SchedulerPlan(chunks=chunks))
        input_ids, positions, meta = inputs.forward_inputs()
        hidden = self.model.forward(input_ids, positions, self.runner.kv_cache, meta)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])  # [num_chunks, vocab]
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    def remove_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.block_ids:
            self.pool.free(seq.block_ids)

    def check_no_leaks(self) -> None:
        assert not self._seqs, f"draft state kept for finished requests: {sorted(self._seqs)}"
        self.pool.check_no_leaks()


def build_draft_proposer(config: EngineConfig, loaded: LoadedModel, num_kv_blocks: int) -> DraftModelProposer:
    """The configured draft model, or the target's first `spec_draft_num_layers` layers."""
    target = loaded.model
    if config.spec_draft_model is None:
        draft = truncated_model(target, min(config.spec_draft_num_layers, target.num_layers))
        logger.info("draft model: the target's first %d of %d layers", draft.num_layers, target.num_layers)
    else:
        from shared.models.loader import load_model

        draft = load_model(config.spec_draft_model, target.attention, config.device, config.torch_dtype,
                           config.cache_dir, config.max_model_len, weight_format=config.weight_format).model
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(f"draft model {config.spec_draft_model} has vocabulary {draft.vocab_size}, "
                              f"the target {target.vocab_size}: they must share a tokenizer")
    # the target's token capacity plus the k - 1 extra slots every running request may hold
    slack = config.max_num_seqs * cdiv(config.num_speculative_tokens, config.block_size)
    return DraftModelProposer(draft, num_kv_blocks + slack, config.block_size, config.device)
