"""The model runner: turns a scheduler plan into one forward pass and samples.

    plan.chunks ──prepare (host)──► planned input_ids / positions / seq_lens + per-sequence
                                    query_start_loc / block_tables / the previous step's row
                ──execute (device)─► prepare_step_inputs: placeholders and positions from the
                                     previous step's outputs, slot_mapping
                ──► model.forward (writes K/V into the paged cache, attends)
                ──► hidden of each sampling chunk's last token ──► logits ──► sampler
                ──► hidden of each verification chunk's last k + 1 tokens ──► logits
                    ──► rejection sampler (shared/spec/verify.py) ──► accepted + 1 tokens
                    (a draft tree's accepted branch: its KV moved to the slots a chain uses)
                ──► StepOutput: emitted tokens left on the device, one row per sampling chunk

`prepare` runs on the engine thread and `execute` on the executor (the same
thread in the synchronous loop): the zero-bubble loop prepares step N+1 while
step N executes, and N+1's `execute` reads N's `StepOutput` where it lies.
The runner owns the KV cache tensor and the per-request random generators.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from shared.engine.cuda_graphs import DecodeGraphs, capture_sizes
from shared.engine.logits.overlap import MaskOverlap, PendingMasks
from shared.engine.logits.processor import LogitsRows, RowGroup
from shared.engine.logits.request_state import RequestLogits
from shared.engine.prompt_logprobs import prompt_logprobs
from shared.engine.request import TokenLogprobs
from shared.engine.sampler import Sampler, make_generator, skip_draws
from shared.engine.scheduler import ScheduledChunk, SchedulerPlan, StepResult
from shared.kv.layout import KVLayout, cdiv
from shared.models.common import LayerDoneFn, PagedCausalLM
from shared.multimodal.encoder import MediaEncoder
from shared.multimodal.items import SEEN_BOTH_WAYS
from shared.ops.argmax_cpu import argmax_rows
from shared.ops.attention import AttentionMetadata
from shared.ops.host_copy import pack_to_device, tensor_to_device, to_device, to_host_async
from shared.ops.step_inputs import PrevOutputs, StepInputsOut, host_step_inputs, prepare_step_inputs_ref
from shared.spec.tree import DraftTree
from shared.spec.verify import VerifyInput, VerifyOutput, verify_drafts

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    plan: SchedulerPlan
    # planned on the host; for chunks that continue the previous step, ids and positions are guesses
    planned_ids: torch.Tensor  # [num_tokens]
    planned_positions: torch.Tensor  # [num_tokens]
    planned_seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    prev_row: torch.Tensor  # [num_seqs] int64: row of the previous step's output a chunk continues, or -1
    query_lens_host: list[int]
    seq_lens_host: list[int]  # upper bounds for continuing chunks
    generators: list[torch.Generator | None]  # per chunk, taken when planned
    sample_rows: list[int]  # index into the flat tokens of each sampling chunk's last token
    sample_chunks: list[int]  # index into plan.chunks, parallel to sample_rows
    hidden_spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # prefill role
    verify_rows: list[int] = field(default_factory=list)  # flat rows scoring each verified position
    verify_chunks: list[int] = field(default_factory=list)  # index into plan.chunks of each verification
    spec_hidden_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    # draft-tree verification chunks: index into plan.chunks -> the tree's ancestor mask on the device
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # with trees: what to subtract from each token's planned (slot) position to get its RoPE position
    rope_offsets: torch.Tensor | None = None
    # further KV layer groups: each group's [num_seqs, max_blocks] table, and each token's sequence
    group_tables: list[torch.Tensor] = field(default_factory=list)
    token_seq: torch.Tensor | None = None  # [num_tokens] int64
    # request id -> its row of the step's outputs: plain sampling chunks first, then verifications
    rows: dict[str, int] = field(default_factory=dict)
    # the four index lists above as device tensors (indexing with a list copies it to the device
    # and waits for that copy)
    device_index: dict[str, torch.Tensor] = field(default_factory=dict)
    # index into plan.chunks -> the logits state of a sampling chunk's request, taken when planned
    logits_states: dict[int, RequestLogits] = field(default_factory=dict)
    # multimodal prompt chunks: soft tokens at their flat rows, and the images seen both ways per chunk
    soft_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # ([m] int64, [m, hidden])
    bidirectional_spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # set by `finish`: the true inputs
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    meta: AttentionMetadata | None = None

    @property
    def continues_previous(self) -> bool:
        return any(c.continues for c in self.plan.chunks)

    def forward_inputs(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, meta) for the forward pass, once `ModelRunner.finish` has run."""
        assert self.input_ids is not None and self.positions is not None and self.meta is not None, "not finished"
        return self.input_ids, self.positions, self.meta


@dataclass
class StepOutput:
    """One step's results as the executor left them: emitted tokens on the device, the rest on the host."""

    plan: SchedulerPlan
    rows: dict[str, int]  # request id -> its row of `device` (sampling chunks only)
    device: PrevOutputs
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)  # prefill role
    spec_hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)  # chunks with return_spec_hidden
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # chunks that asked

    # CUDA: pinned host copies of (emitted, num_emitted) and the event that marks them done
    _host: tuple[torch.Tensor, torch.Tensor] | None = None
    _copied: torch.cuda.Event | None = None
    _result: StepResult | None = None  # read once; the next step's logits processing may read it first

    def stage_to_host(self) -> None:
        """Queue the copy of the emitted tokens to the host right behind this step's kernels (CUDA).

        `result` then waits for this step alone: a plain read would also wait for the next
        step, which the zero-bubble loop has queued behind this one by the time it reads.
        """
        if not self.device.emitted.is_cuda or self.device.emitted.numel() == 0:
            return
        (emitted, counts), self._copied = to_host_async(self.device.emitted, self.device.num_emitted)
        self._host = (emitted, counts)

    def result(self) -> StepResult:
        """Read the emitted tokens to the host: the one device-to-host copy of a step.

        Both threads of the zero-bubble loop may ask (the next step's logits processing and the engine);
        whichever comes second finds it read.
        """
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> StepResult:
        emitted_t, counts_t = self.device.emitted, self.device.num_emitted
        if self._host is not None and self._copied is not None:
            self._copied.synchronize()
            emitted_t, counts_t = self._host
        emitted = emitted_t.tolist() if emitted_t.numel() else []
        counts = counts_t.tolist() if counts_t.numel() else []
        return StepResult(
            emitted={rid: emitted[r][: counts[r]] for rid, r in self.rows.items()},
            logprobs=self.logprobs,
            hidden_states=self.hidden_states,
            spec_hidden_states=self.spec_hidden_states,
            prompt_logprobs=self.prompt_logprobs,
        )


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
    def __init__(self, model: PagedCausalLM, layout: KVLayout, device: str = "cpu", seed: int = 0,
                 aux_hidden_layers: tuple[int, ...] = ()) -> None:
        """`aux_hidden_layers`: layers whose outputs follow the final hidden states in handed-out hidden
        states, as an EAGLE-3 head reads them: [num_tokens, hidden * (1 + len(aux_hidden_layers))]."""
        self.model = model
        self.aux_hidden_layers = aux_hidden_layers
        self.layout = layout
        self.device = torch.device(device)
        self.kv_cache = layout.allocate(self.device)  # KVLayout.shape
        # what the model's forward reads: the 6-D cache itself, or each layer's (keys, values) views of it
        self.model_kv = layout.model_cache(self.kv_cache)
        self.sampler = Sampler(seed=seed)
        self._generators: dict[str, torch.Generator | None] = {}
        self._logits: dict[str, RequestLogits] = {}  # requests with logits processing (shared/engine/logits/)
        self.clock = ExecutorClock()
        self.graphs: DecodeGraphs | None = None
        # constraints built on a worker thread during the forward (logits/overlap.py); False builds them after
        self.overlap_masks = True
        self.masks = MaskOverlap()
        self.media_encoder: MediaEncoder | None = None  # a multimodal model's towers (set by the engine)
        self.bidirectional_every_layer = False  # its images' spans hold on every layer (set by the engine)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, scratch_block: int) -> None:
        """Replay decode steps of up to `max_num_seqs` single-token sequences from CUDA graphs.

        `scratch_block`: a KV block no request ever owns, where padding rows write.
        """
        block_size = self.layout.block_size
        max_blocks = cdiv(max_model_len + 1, block_size)
        graphs = DecodeGraphs(capture_sizes(max_num_seqs), max_blocks, block_size, scratch_block, self.device)
        graphs.capture(lambda ids, pos, meta: self.model.forward(ids, pos, self.model_kv, meta))
        self.graphs = graphs

    def add_request(self, request_id: str, seed: int | None, num_steps_done: int = 0,
                    logits: RequestLogits | None = None) -> None:
        """Give a request its generator (and its logits state); `num_steps_done` replays draws made elsewhere.

        A seeded request that was prefilled by another engine has already taken
        one step of draws there; replaying them keeps its tokens identical to a
        colocated run with the same seed.
        """
        gen = make_generator(seed, self.device)
        if gen is not None:
            skip_draws(gen, self.model.vocab_size, num_steps_done, self.device)
        self._generators[request_id] = gen
        if logits is not None:
            self._logits[request_id] = logits

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._logits.pop(request_id, None)  # a step in flight holds its own reference

    def prepare(self, plan: SchedulerPlan, prev_rows: dict[str, int] | None = None) -> StepInputs:
        """Host half of a step. `prev_rows`: the previous step's output rows, for chunks that continue it.

        Inputs that need nothing from the previous step are finished at once; the others when
        `execute` has the previous step's outputs.
        """
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        prev_row: list[int] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        spans: dict[str, tuple[int, int]] = {}
        spec_spans: dict[str, tuple[int, int]] = {}
        verify_rows: list[int] = []
        verify_chunks: list[int] = []
        trees: dict[int, DraftTree] = {}
        logits_states: dict[int, RequestLogits] = {}
        soft_rows: list[int] = []
        soft_values: list[torch.Tensor] = []
        bidirectional: dict[int, list[tuple[int, int]]] = {}
        max_blocks = max((len(c.block_ids) for c in plan.chunks), default=1)
        tables = np.zeros((len(plan.chunks), max_blocks), dtype=np.int32)
        self._encode_media(plan)
        for i, chunk in enumerate(plan.chunks):
            lo = len(ids)
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + chunk.num_tokens))
            tables[i, : len(chunk.block_ids)] = chunk.block_ids
            query_lens.append(chunk.num_tokens)
            seq_lens.append(chunk.start_pos + chunk.num_tokens)
            prev_row.append(prev_rows[chunk.request_id] if chunk.continues and prev_rows is not None else -1)
            assert not chunk.continues or prev_row[-1] >= 0, f"{chunk.request_id} continues no known step"
            if chunk.draft_tree is not None:
                trees[i] = chunk.draft_tree
            if chunk.sample and chunk.request_id in self._logits:
                logits_states[i] = self._logits[chunk.request_id]
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
            if chunk.media:
                self._media_rows(chunk, i, lo, soft_rows, soft_values, bidirectional)
        dev = self.device
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        i64, i32 = torch.int64, torch.int32
        (planned_ids, planned_positions, planned_seq_lens, query_start_loc, block_tables, prev_row_t,
         *index) = pack_to_device([(ids, i64), (positions, i64), (seq_lens, i32), (cu, i32), (tables, i32),
                                   (prev_row, i64), (sample_rows, i64), (sample_chunks, i64), (verify_rows, i64),
                                   (verify_chunks, i64)], dev)
        inputs = StepInputs(
            plan=plan,
            planned_ids=planned_ids,
            planned_positions=planned_positions,
            planned_seq_lens=planned_seq_lens,
            query_start_loc=query_start_loc,
            block_tables=block_tables,
            prev_row=prev_row_t,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            generators=[self._generators.get(c.request_id) for c in plan.chunks],
            sample_rows=sample_rows,
            sample_chunks=sample_chunks,
            hidden_spans=spans,
            verify_rows=verify_rows,
            verify_chunks=verify_chunks,
            spec_hidden_spans=spec_spans,
            logits_states=logits_states,
            bidirectional_spans=bidirectional,
        )
        if soft_rows:
            inputs.soft_tokens = (to_device(soft_rows, dtype=torch.int64, device=dev),
                                  tensor_to_device(torch.cat(soft_values), dev))
        if plan.chunks and plan.chunks[0].group_block_ids:
            self._group_inputs(inputs, plan, query_lens)
        if trees:  # node j of a tree sits at slot start + j and RoPE position start + depth(j)
            inputs.tree_masks = {i: tree.ancestor_mask(dev) for i, tree in trees.items()}
            offsets = [0] * len(ids)
            for i, tree in trees.items():
                lo = cu[i + 1] - tree.num_drafts - 1
                offsets[lo : cu[i + 1]] = [j - d for j, d in enumerate(tree.depths)]
            inputs.rope_offsets = to_device(offsets, dtype=torch.int64, device=dev)
        inputs.device_index = dict(zip(("sample_rows", "sample_chunks", "verify_rows", "verify_chunks"), index,
                                       strict=True))
        order = [plan.chunks[i].request_id for i in sample_chunks + verify_chunks]
        inputs.rows = {request_id: r for r, request_id in enumerate(order)}
        if not inputs.continues_previous:
            self.finish(inputs, None)
        return inputs

    def _encode_media(self, plan: SchedulerPlan) -> None:
        """Soft tokens for every item the step's chunks read that has none yet, in one batch across requests
        (an item nothing prepared, a decode engine recomputing a preempted prompt, is prepared here)."""
        pending = [(chunk.request_id, m) for chunk in plan.chunks for m in chunk.media if m.embeds is None]
        if not pending:
            return
        encoder = self.media_encoder
        assert encoder is not None, "the engine admits media only for a multimodal model"
        for _, m in pending:
            if m.prepared is None:
                encoder.prepare_input(m)
        todo = [(m, m.prepared) for _, m in pending if m.prepared is not None and m.embeds is None]
        ids = ",".join(sorted({request_id for request_id, _ in pending}))
        for (m, _), embeds in zip(todo, encoder.encode_batch([p for _, p in todo], ids), strict=True):
            m.embeds, m.prepared = embeds, None

    def _media_rows(self, chunk: ScheduledChunk, index: int, lo: int, rows: list[int], values: list[torch.Tensor],
                    bidirectional: dict[int, list[tuple[int, int]]]) -> None:
        """The soft tokens a prompt chunk covers (encoded by `_encode_media`), and its images (and video frames)
        seen both ways."""
        start, end = chunk.start_pos, chunk.start_pos + chunk.num_tokens
        for media in chunk.media:
            item = media.item
            assert media.embeds is not None, (chunk.request_id, item.kind)
            first, last = max(start, item.offset), min(end, item.end)
            rows.extend(range(lo + first - start, lo + last - start))
            values.append(media.embeds[first - item.offset : last - item.offset])
            if chunk.bidirectional_images and item.kind in SEEN_BOTH_WAYS:  # each frame a block of its own
                bidirectional.setdefault(index, []).append((item.offset, item.end))

    def _group_inputs(self, inputs: StepInputs, plan: SchedulerPlan, query_lens: list[int]) -> None:
        """Block tables of the further layer groups (hybrid_kv.py), and which sequence each token is of."""
        for g in range(len(plan.chunks[0].group_block_ids)):
            tables = [c.group_block_ids[g] for c in plan.chunks]
            padded = torch.zeros((len(tables), max(max(len(t) for t in tables), 1)), dtype=torch.int32)
            for i, table in enumerate(tables):
                padded[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            inputs.group_tables.append(tensor_to_device(padded, self.device))
        seqs = [i for i, q in enumerate(query_lens) for _ in range(q)]
        inputs.token_seq = to_device(seqs, dtype=torch.int64, device=self.device)

    def finish(self, inputs: StepInputs, prev: StepOutput | None) -> None:
        """Device half of the inputs: the previous step's tokens and accepted counts, and the KV slots."""
        if inputs.meta is not None:
            return
        if prev is None and not inputs.planned_ids.is_cuda:  # the CPU's synchronous loop: nothing to take
            out = host_step_inputs(inputs.planned_ids, inputs.planned_positions, inputs.planned_seq_lens,
                                   inputs.query_lens_host, inputs.block_tables, self.layout.block_size)
        else:
            prev_out = prev.device if prev is not None else PrevOutputs.empty(self.device)
            out = _prepare_step_inputs(
                inputs.planned_ids, inputs.planned_positions, inputs.planned_seq_lens, inputs.query_start_loc,
                inputs.block_tables, inputs.prev_row, prev_out, self.layout.block_size,
            )
        positions = out.positions if inputs.rope_offsets is None else out.positions - inputs.rope_offsets
        inputs.input_ids = out.input_ids
        inputs.positions = positions
        inputs.meta = AttentionMetadata(
            slot_mapping=out.slot_mapping,
            query_start_loc=inputs.query_start_loc,
            seq_lens=out.seq_lens,
            block_tables=inputs.block_tables,
            query_lens_host=inputs.query_lens_host,
            seq_lens_host=inputs.seq_lens_host,
            positions=positions,
            tree_masks=inputs.tree_masks,
            bidirectional_spans=inputs.bidirectional_spans,
            bidirectional_every_layer=self.bidirectional_every_layer,
        )
        if inputs.group_tables:  # each group's slot of each token, from the same (slot) positions
            bs, slot_pos = self.layout.block_size, out.positions
            inputs.meta.group_tables = [
                (table, table[inputs.token_seq, slot_pos // bs].long() * bs + slot_pos % bs)
                for table in inputs.group_tables]

    def execute(self, inputs: StepInputs, prev: StepOutput | None = None,
                on_layer_done: LayerDoneFn | None = None) -> StepOutput:
        """Device half of a step: inputs, forward, sampling and verification (timed by `clock`)."""
        self.clock.begin()
        try:
            return self._execute(inputs, prev, on_layer_done)
        finally:
            self.clock.end()

    @torch.inference_mode()
    def _execute(self, inputs: StepInputs, prev: StepOutput | None, on_layer_done: LayerDoneFn | None) -> StepOutput:
        self.finish(inputs, prev)
        plan = inputs.plan
        burst = plan.chunks[0].burst if plan.chunks else 1
        if burst > 1:
            return self._execute_burst(inputs, burst)
        input_ids, positions, meta = inputs.forward_inputs()
        captured = {layer: torch.empty(0) for layer in self.aux_hidden_layers} if inputs.hidden_spans else None
        masks = self._start_masks(inputs, prev)
        if self.graphs is not None and on_layer_done is None and captured is None and inputs.soft_tokens is None \
                and self.graphs.fits(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            extra = {"soft_tokens": inputs.soft_tokens} if inputs.soft_tokens is not None else {}
            hidden = self.model.forward(input_ids, positions, self.model_kv, meta, on_layer_done, captured, **extra)
        out = StepOutput(plan, inputs.rows, PrevOutputs.empty(self.device))
        for request_id, (lo, hi) in inputs.hidden_spans.items():
            parts = [hidden[lo:hi], *(captured[layer][lo:hi] for layer in self.aux_hidden_layers)] if captured \
                else [hidden[lo:hi]]
            out.hidden_states[request_id] = torch.cat(parts, dim=-1).to("cpu")  # cat copies: no view kept
        for request_id, (lo, hi) in inputs.spec_hidden_spans.items():
            out.spec_hidden_states[request_id] = hidden[lo:hi].clone()
        lo = 0
        for chunk, num_tokens in zip(plan.chunks, inputs.query_lens_host, strict=True):
            if chunk.prompt_logprob_targets:
                targets = chunk.prompt_logprob_targets
                out.prompt_logprobs[chunk.request_id] = prompt_logprobs(
                    self.model.compute_logits, hidden[lo : lo + len(targets)], targets, chunk.params.prompt_logprobs or 0)
            lo += num_tokens
        sample_masks, verify_masks = masks.result() if masks is not None else (None, None)
        below_min = self._positions_below_min(inputs, prev)
        rows: list[torch.Tensor] = []  # [n, width] blocks of emitted ids, in row order
        counts: list[torch.Tensor] = []
        drafts: list[torch.Tensor] = []
        if inputs.sample_rows:
            active = below_min[inputs.device_index["sample_chunks"]] > 0 if below_min is not None else None
            sampled = self._sample(inputs, hidden, out, active, sample_masks)
            rows.append(sampled.unsqueeze(1))
            counts.append(torch.ones_like(sampled))
            drafts.append(torch.zeros_like(sampled))
        if inputs.verify_rows:
            num_suppressed = below_min[inputs.device_index["verify_chunks"]] if below_min is not None else None
            verified, num_drafts = self._verify(inputs, hidden, out, num_suppressed, verify_masks)
            if inputs.tree_masks:
                self._settle_trees(inputs, hidden, verified, out)
            rows.append(verified.token_ids)
            counts.append(verified.num_accepted + 1)
            drafts.append(num_drafts)
        if rows:
            width = max(r.shape[1] for r in rows)
            emitted = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=-1) for r in rows])
            out.device = PrevOutputs(emitted, torch.cat(counts), torch.cat(drafts))
            out.stage_to_host()
        return out

    def _execute_burst(self, inputs: StepInputs, burst: int) -> StepOutput:
        """`burst` greedy decode steps back to back, each fed the tokens the one before chose, with nothing read
        on the host in between; row r of the output holds request r's `burst` tokens.

        The scheduler plans a burst only for one-token greedy decodes with nothing reading their logits
        (`Scheduler._plan_burst`), so each step is the plain step's forward, LM head and argmax (the sampler's
        greedy rule), and the KV slots of all of them are reserved.
        """
        plan = inputs.plan
        assert all(c.burst == burst and c.num_tokens == 1 and c.sample and not c.num_draft_tokens
                   and c.params.is_greedy for c in plan.chunks), "a burst of plain greedy decodes only"
        input_ids, positions, meta = inputs.forward_inputs()
        no_prev = torch.full((len(plan.chunks),), -1, dtype=torch.int64, device=self.device)
        steps: list[torch.Tensor] = []
        for step in range(burst):
            if step:  # the next position of every sequence, its slot from the same tables (the step-inputs op)
                nxt = _prepare_step_inputs(steps[-1], positions + 1, meta.seq_lens + 1, meta.query_start_loc,
                                           meta.block_tables, no_prev, PrevOutputs.empty(self.device),
                                           self.layout.block_size)
                input_ids, positions = nxt.input_ids, nxt.positions
                meta = replace(meta, positions=positions, seq_lens=nxt.seq_lens, slot_mapping=nxt.slot_mapping,
                               seq_lens_host=[n + 1 for n in meta.seq_lens_host], step_cache={})
            if self.graphs is not None and self.graphs.fits(meta):
                hidden = self.graphs.run(input_ids, positions, meta)
            else:
                hidden = self.model.forward(input_ids, positions, self.model_kv, meta)
            steps.append(argmax_rows(self.model.compute_logits(hidden)))
        emitted = torch.stack(steps, dim=1)  # [n, burst]
        out = StepOutput(plan, inputs.rows, PrevOutputs(
            emitted, torch.full_like(steps[0], burst), torch.full_like(steps[0], burst - 1)))
        out.stage_to_host()
        return out

    def _positions_below_min(self, inputs: StepInputs, prev: StepOutput | None) -> torch.Tensor | None:
        """Per chunk, on the device: how many of its sampling positions are still below min_tokens.

        Only needed where the host cannot know: a chunk that continues the previous step and may be
        below min_tokens, whose count grows by the drafts that step rejected. None = the host's
        counts (`num_suppressed_positions`) are exact.
        """
        chunks = inputs.plan.chunks
        if prev is None or not any(c.continues and c.suppress_token_ids for c in chunks):
            return None
        planned = to_device([c.num_suppressed_positions for c in chunks], dtype=torch.int64, device=self.device)
        return planned + prev.device.rejected(inputs.prev_row)

    def _start_masks(self, inputs: StepInputs, prev: StepOutput | None) -> PendingMasks[StepMasks] | None:
        """Begin building the step's constraints (None: no request has any); on the worker when overlapping."""
        if not inputs.logits_states:
            return None
        pending = self.masks.submit(lambda: _build_masks(inputs, prev, self.model.vocab_size))
        if not self.overlap_masks:
            pending.result()
        return pending

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, out: StepOutput,
                suppress_active: torch.Tensor | None, rows: LogitsRows | None) -> torch.Tensor:
        """One token per plain sampling chunk, [num_sample] on the device."""
        logits = self.model.compute_logits(hidden[inputs.device_index["sample_rows"]])  # [num_sample, vocab]
        chunks = [inputs.plan.chunks[i] for i in inputs.sample_chunks]
        suppress_ids = [c.suppress_token_ids for c in chunks]
        if rows is not None:  # a grammar or a forced token decides instead of min_tokens
            suppress_ids = [frozenset() if constrained else ids
                            for ids, constrained in zip(suppress_ids, rows.is_constrained, strict=True)]
        sampled = self.sampler(
            rows.apply(logits) if rows is not None else logits,
            [c.params for c in chunks],
            [inputs.generators[i] for i in inputs.sample_chunks],
            suppress_ids,
            suppress_active,
            raw_logits=logits,
        )
        for chunk, lp in zip(chunks, sampled.logprobs, strict=True):
            if lp is not None:
                out.logprobs[chunk.request_id] = [lp]
        return sampled.token_ids

    def _verify(self, inputs: StepInputs, hidden: torch.Tensor, out: StepOutput,
                num_suppressed: torch.Tensor | None, rows: LogitsRows | None) -> tuple[VerifyOutput, torch.Tensor]:
        """Rejection-sample every verification chunk's drafts against the target's logits."""
        logits = self.model.compute_logits(hidden[inputs.device_index["verify_rows"]])  # [num_verify_rows, vocab]
        chunks = [inputs.plan.chunks[i] for i in inputs.verify_chunks]
        drafts = _verify_drafts(inputs)
        constrained = _constrained_chunks(rows, [len(d) + 1 for d in drafts])
        verify_inputs = [
            VerifyInput(
                draft_token_ids=d,
                params=c.params,
                generator=inputs.generators[i],
                # a grammar or a forced token decides instead of min_tokens
                suppress_token_ids=frozenset() if is_constrained else c.suppress_token_ids,
                num_suppressed_positions=c.num_suppressed_positions,
                tree=c.draft_tree,
            )
            for i, c, d, is_constrained in zip(inputs.verify_chunks, chunks, drafts, constrained, strict=True)
        ]
        verified = verify_drafts(rows.apply(logits) if rows is not None else logits, verify_inputs, self.sampler,
                                 num_suppressed, raw_logits=logits)
        for chunk, lps in zip(chunks, verified.logprobs, strict=False):  # [] when no chunk asked
            if lps:
                out.logprobs[chunk.request_id] = lps
        num_drafts = to_device([c.num_draft_tokens for c in chunks], dtype=torch.int64, device=self.device)
        return verified, num_drafts

    def _settle_trees(self, inputs: StepInputs, hidden: torch.Tensor, verified: VerifyOutput,
                      out: StepOutput) -> None:
        """Each tree's accepted branch wrote its KV at its nodes' slots (start + node): move it to the slots a
        chain of the same tokens would hold (start + depth), and keep the branch's hidden states, on the device.
        """
        assert verified.branch is not None
        chunks = inputs.plan.chunks
        at = [r for r, i in enumerate(inputs.verify_chunks) if i in inputs.tree_masks]  # rows of `verified`
        tree_chunks = [inputs.verify_chunks[r] for r in at]
        dev = self.device
        index = to_device(at, dtype=torch.int64, device=dev)
        branch = verified.branch[index]  # [T, width] node at each accepted depth, root first
        depth = torch.arange(branch.shape[1], device=dev)
        start = to_device([chunks[i].start_pos for i in tree_chunks], dtype=torch.int64, device=dev)[:, None]
        dst = start + depth
        src = torch.where(depth <= verified.num_accepted[index][:, None], start + branch, dst)
        tables = inputs.block_tables[to_device(tree_chunks, dtype=torch.int64, device=dev)].long()
        bs = self.layout.block_size

        def blocks(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return tables.gather(1, slots // bs).flatten(), (slots % bs).flatten()

        (src_block, src_off), (dst_block, dst_off) = blocks(src), blocks(dst)
        # kv_cache [layers, blocks, 2, block_size, heads, dim]: the gather copies before the scatter writes
        self.kv_cache[:, dst_block, :, dst_off] = self.kv_cache[:, src_block, :, src_off]
        for n, i in enumerate(tree_chunks):
            request_id = chunks[i].request_id
            if request_id in inputs.spec_hidden_spans:
                lo, _ = inputs.spec_hidden_spans[request_id]
                out.spec_hidden_states[request_id] = hidden[lo + branch[n]]  # the first accepted + 1 rows count


StepMasks = tuple[LogitsRows | None, LogitsRows | None]  # (plain sampling rows, verification rows)


def _verify_drafts(inputs: StepInputs) -> list[list[int]]:
    """Each verification chunk's draft tokens."""
    chunks = [inputs.plan.chunks[i] for i in inputs.verify_chunks]
    return [c.token_ids[c.num_tokens - c.num_draft_tokens :] for c in chunks]


def _build_masks(inputs: StepInputs, prev: StepOutput | None, vocab_size: int) -> StepMasks:
    """The step's constraints: states synced to the output before the step, then each row's mask."""
    _sync_logits_states(inputs, prev)
    sample = LogitsRows.build([RowGroup(inputs.logits_states.get(i)) for i in inputs.sample_chunks],
                              vocab_size) if inputs.sample_rows else None
    chunks = [inputs.plan.chunks[i] for i in inputs.verify_chunks]
    verify = LogitsRows.build([RowGroup(inputs.logits_states.get(i), d, c.draft_tree)
                               for i, c, d in zip(inputs.verify_chunks, chunks, _verify_drafts(inputs), strict=True)],
                              vocab_size) if inputs.verify_rows else None
    return sample, verify


def _sync_logits_states(inputs: StepInputs, prev: StepOutput | None) -> None:
    """Bring each sampling chunk's logits state to the output before its first sampled position.

    A chunk that continues the previous step also follows what that step emitted: read from its
    outputs here, after this step's forward was queued (on a GPU the read waits for that step alone).
    """
    for i, state in inputs.logits_states.items():
        chunk = inputs.plan.chunks[i]
        if not chunk.params.needs_history:
            continue
        history = chunk.output_token_ids[: chunk.num_known_outputs]
        if chunk.continues:
            assert prev is not None, f"{chunk.request_id} continues no known step"
            history += prev.result().emitted[chunk.request_id]
        state.sync(history)


def _constrained_chunks(rows: LogitsRows | None, sizes: list[int]) -> list[bool]:
    """Per chunk of `sizes` rows: whether a grammar or a forced token constrains any of its rows."""
    if rows is None:
        return [False] * len(sizes)
    flags = rows.is_constrained
    out, lo = [], 0
    for size in sizes:
        out.append(any(flags[lo : lo + size]))
        lo += size
    return out


def _prepare_step_inputs(input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, block_tables: torch.Tensor, prev_row: torch.Tensor,
                         prev: PrevOutputs, block_size: int) -> StepInputsOut:
    """The Triton kernel on CUDA, the torch reference elsewhere (identical results)."""
    if input_ids.is_cuda:
        from shared.ops.step_inputs_triton import prepare_step_inputs_triton, triton_available

        if triton_available():
            return prepare_step_inputs_triton(input_ids, positions, seq_lens, query_start_loc, block_tables,
                                              prev_row, prev, block_size)
    return prepare_step_inputs_ref(input_ids, positions, seq_lens, query_start_loc, block_tables, prev_row,
                                   prev, block_size)
