"""The model runner: turns a scheduler plan into one forward pass and samples.

    plan.chunks ──► flat input_ids / positions / slot_mapping + per-sequence
                    query_start_loc / seq_lens / block_tables
                ──► model.forward (writes K/V into the paged cache, attends)
                ──► hidden of each sampling chunk's last token ──► logits ──► sampler
                ──► hidden of each verification chunk's last k + 1 tokens ──► logits
                    ──► rejection sampler (shared/spec/verify.py) ──► accepted + 1 tokens

The runner owns the KV cache tensor and the per-request random generators.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from shared.engine.sampler import Sampler, make_generator, skip_draws
from shared.engine.scheduler import SchedulerPlan, StepResult
from shared.kv.layout import KVLayout
from shared.models.common import LayerDoneFn
from shared.models.decoder import DecoderLM
from shared.ops.attention import AttentionMetadata
from shared.spec.verify import VerifyInput, verify_drafts

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: list[int]  # index into the flat tokens of each sampling chunk's last token
    sample_chunks: list[int]  # index into plan.chunks, parallel to sample_rows
    hidden_spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # prefill role
    verify_rows: list[int] = field(default_factory=list)  # flat rows scoring each verified position
    verify_chunks: list[int] = field(default_factory=list)  # index into plan.chunks of each verification
    spec_hidden_spans: dict[str, tuple[int, int]] = field(default_factory=dict)


class ExecutorClock:
    """Executor busy time and the gaps between consecutive executor steps (the loop's bubbles).

    A gap counts from the end of one step to the start of the next while the
    engine has work; the engine calls `pause` when it runs out, so waiting for
    the next request is not counted. idle ratio = idle / (idle + busy).
    """

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._last_end_s: float | None = None
        self._start_s = 0.0

    def begin(self) -> None:
        now = time.perf_counter()
        if self._last_end_s is not None:
            self.idle_s += now - self._last_end_s
        self._start_s = now

    def end(self) -> None:
        now = time.perf_counter()
        self.busy_s += now - self._start_s
        self._last_end_s = now

    def pause(self) -> None:
        self._last_end_s = None

    @property
    def idle_ratio(self) -> float:
        total = self.idle_s + self.busy_s
        return self.idle_s / total if total > 0 else 0.0


class ModelRunner:
    def __init__(self, model: DecoderLM, layout: KVLayout, device: str = "cpu", seed: int = 0,
                 aux_hidden_layers: tuple[int, ...] = ()) -> None:
        """`aux_hidden_layers`: layers whose outputs follow the final hidden states in handed-out hidden
        states, as an EAGLE-3 head reads them: [num_tokens, hidden * (1 + len(aux_hidden_layers))]."""
        self.model = model
        self.aux_hidden_layers = aux_hidden_layers
        self.layout = layout
        self.device = torch.device(device)
        self.kv_cache = layout.allocate(self.device)  # KVLayout.shape
        self.sampler = Sampler(seed=seed)
        self._generators: dict[str, torch.Generator | None] = {}
        self.clock = ExecutorClock()

    def add_request(self, request_id: str, seed: int | None, num_steps_done: int = 0) -> None:
        """Give a request its generator; `num_steps_done` replays draws made elsewhere.

        A seeded request that was prefilled by another engine has already taken
        one step of draws there; replaying them keeps its tokens identical to a
        colocated run with the same seed.
        """
        gen = make_generator(seed, self.device)
        if gen is not None:
            skip_draws(gen, self.model.vocab_size, num_steps_done, self.device)
        self._generators[request_id] = gen

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def prepare(self, plan: SchedulerPlan) -> StepInputs:
        bs = self.layout.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        spans: dict[str, tuple[int, int]] = {}
        spec_spans: dict[str, tuple[int, int]] = {}
        verify_rows: list[int] = []
        verify_chunks: list[int] = []
        max_blocks = max((len(c.block_ids) for c in plan.chunks), default=1)
        tables = torch.zeros((len(plan.chunks), max_blocks), dtype=torch.int32)
        for i, chunk in enumerate(plan.chunks):
            lo = len(ids)
            ids.extend(chunk.token_ids)
            pos = range(chunk.start_pos, chunk.start_pos + chunk.num_tokens)
            positions.extend(pos)
            table = torch.tensor(chunk.block_ids, dtype=torch.int64)
            tables[i, : len(chunk.block_ids)] = table.to(torch.int32)
            p = torch.arange(pos.start, pos.stop, dtype=torch.int64)
            slots.append(table[p // bs] * bs + p % bs)
            query_lens.append(chunk.num_tokens)
            seq_lens.append(pos.stop)
            if chunk.num_draft_tokens:
                verify_rows.extend(range(len(ids) - chunk.num_draft_tokens - 1, len(ids)))
                verify_chunks.append(i)
            elif chunk.sample:
                sample_rows.append(len(ids) - 1)
                sample_chunks.append(i)
            if chunk.return_hidden:
                spans[chunk.request_id] = (lo, len(ids))
            if chunk.return_spec_hidden:
                spec_spans[chunk.request_id] = (lo, len(ids))
        dev = self.device
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            sample_rows=sample_rows,
            sample_chunks=sample_chunks,
            hidden_spans=spans,
            verify_rows=verify_rows,
            verify_chunks=verify_chunks,
            spec_hidden_spans=spec_spans,
        )

    def execute(self, plan: SchedulerPlan, on_layer_done: LayerDoneFn | None = None) -> StepResult:
        """Run one step: inputs, forward, sampling and verification (timed by `clock`)."""
        self.clock.begin()
        try:
            return self._execute(plan, on_layer_done)
        finally:
            self.clock.end()

    @torch.inference_mode()
    def _execute(self, plan: SchedulerPlan, on_layer_done: LayerDoneFn | None) -> StepResult:
        inputs = self.prepare(plan)
        captured = {layer: torch.empty(0) for layer in self.aux_hidden_layers} if inputs.hidden_spans else None
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, on_layer_done,
                                    captured)
        result = StepResult()
        for request_id, (lo, hi) in inputs.hidden_spans.items():
            parts = [hidden[lo:hi], *(captured[layer][lo:hi] for layer in self.aux_hidden_layers)] if captured \
                else [hidden[lo:hi]]
            result.hidden_states[request_id] = torch.cat(parts, dim=-1).to("cpu")  # cat copies: no view kept
        for request_id, (lo, hi) in inputs.spec_hidden_spans.items():
            result.spec_hidden_states[request_id] = hidden[lo:hi].clone()
        if inputs.verify_rows:
            self._verify(plan, inputs, hidden, result)
        if not inputs.sample_rows:
            return result
        logits = self.model.compute_logits(hidden[inputs.sample_rows])  # [num_sample, vocab]
        chunks = [plan.chunks[i] for i in inputs.sample_chunks]
        out = self.sampler(
            logits,
            [c.params for c in chunks],
            [self._generators.get(c.request_id) for c in chunks],
            [c.suppress_token_ids for c in chunks],
        )
        token_ids = out.token_ids.tolist()
        for chunk, token_id, lp in zip(chunks, token_ids, out.logprobs, strict=True):
            result.sampled_token_ids[chunk.request_id] = token_id
            result.logprobs[chunk.request_id] = lp
        return result

    def _verify(self, plan: SchedulerPlan, inputs: StepInputs, hidden: torch.Tensor, result: StepResult) -> None:
        """Rejection-sample every verification chunk's drafts against the target's logits."""
        logits = self.model.compute_logits(hidden[inputs.verify_rows])  # [num_verify_rows, vocab]
        chunks = [plan.chunks[i] for i in inputs.verify_chunks]
        verify_inputs = [
            VerifyInput(
                draft_token_ids=c.token_ids[c.num_tokens - c.num_draft_tokens :],
                params=c.params,
                generator=self._generators.get(c.request_id),
                suppress_token_ids=c.suppress_token_ids,
                num_suppressed_positions=c.num_suppressed_positions,
            )
            for c in chunks
        ]
        token_ids, logprobs = verify_drafts(logits, verify_inputs, self.sampler)
        for chunk, ids, lps in zip(chunks, token_ids, logprobs, strict=True):
            result.verified_token_ids[chunk.request_id] = ids
            result.verified_logprobs[chunk.request_id] = lps
