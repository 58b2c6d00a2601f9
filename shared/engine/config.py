"""Engine configuration: one frozen object, validated once.

Services build it from their pydantic settings; the CLI from its flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.precision import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, Precision, resolve_precision
from shared.engine.request import MAX_STREAM_INTERVAL
from shared.models.weight_format import QUANTIZATIONS, WeightFormat

ATTENTION_BACKENDS = ("auto", "torch", "triton")
SPEC_METHODS = ("none", "ngram", "draft", "eagle", "gemma4_assistant")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    role: str = "colocated"  # colocated | prefill | decode
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # KV budget; ignored when num_kv_blocks is set
    # host memory for evicted prefix blocks (shared/engine/kv_offload.py): a preempted request's context is
    # restored from there instead of recomputed; 0 = off (vLLM's CPU KV offload is opt-in too)
    kv_offload_bytes: int = 0
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = 8192  # capped at the model's own limit
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: str = "float32"  # vLLM's --dtype: auto | float32 | bfloat16 | float16 (shared/engine/precision.py)
    # vLLM's --kv-cache-dtype: auto (= the weights') | float32 | bfloat16 | fp8 (= fp8_e4m3) | fp8_e5m2
    kv_cache_dtype: str = "auto"
    quantization: str = "none"  # vLLM's --quantization: none | int8 | gguf (shared/models/weight_format.py)
    attention_backend: str = "auto"  # auto: Triton on CUDA, C++ decode kernel + torch reference on the CPU
    seed: int = 0
    cache_dir: Path = field(default=DEFAULT_CACHE_DIR)
    # speculative decoding (decode and colocated roles; a prefill engine ignores it)
    spec_method: str = "none"  # none | ngram | draft | eagle | gemma4_assistant
    num_speculative_tokens: int = 3  # drafts per step; a request may ask for fewer
    # draft: alias, GGUF or HF dir (None = the target truncated); gemma4_assistant: the assistant's HF dir
    spec_draft_model: str | None = None
    spec_draft_num_layers: int = 4  # draft with no spec_draft_model: the target's first N layers
    spec_eagle_head: Path | None = None  # eagle: safetensors from `baton train-draft`
    # rows of the target's hidden states the EAGLE head attends over when drafting (their keys and values
    # are computed once per step). On the held-out chat prompts 8, 16 and 64 accept alike (1.84, 1.87 and
    # 1.89 tokens per step with the H100-trained head of 2026-11-23, bench/eagle_offline.py)
    spec_eagle_window: int = 16
    # decode steps with more requests decoding than this run without drafts (None: never); see Speculator.propose
    spec_disable_batch_size: int | None = None
    # eagle: greedy requests draft this tree instead of a chain of num_speculative_tokens (shared/spec/tree.py),
    # e.g. "0;1;2;0.0;0.1;1.0;0.0.0;0.0.0.0"; None = chains only. Sampled requests keep chains
    spec_tree: str | None = None
    # prefill role: layers whose outputs travel after the final hidden states (EAGLE-3 style draft input)
    aux_hidden_layers: tuple[int, ...] = ()
    # zero-bubble loop: plan step N+1 while step N runs on an executor thread (colocated and decode roles;
    # the draft and eagle proposers need each step's tokens first and keep the synchronous loop).
    # None = on with CUDA, off on the CPU, where the executor needs every core for its own math and
    # the host's work between steps is ~1% of a step (bench/spec_decode.py measures both)
    async_scheduling: bool | None = None
    # grammar fast-forward: the tokens a request's grammar forces next are drafted for free and verified in
    # one pass (shared/spec/grammar_drafts.py); works with spec_method "none" too
    grammar_fast_forward: bool = True
    # ... only while at most this many requests decode: forced drafts lengthen every verification chunk, and
    # once the batch makes the step compute-bound they cost more than the steps they save (SmolLM2 on two
    # CPU cores, bench/structured.py with no limit: 1.63x at batch 1, 1.29x at 2, 0.97x at 4, 0.94x at 8,
    # 0.86x at 16)
    grammar_fast_forward_max_batch: int = 2
    # multi-step decode (vLLM's --num-scheduler-steps): a step where every request decodes greedily with nothing
    # reading its logits runs up to this many decode steps back to back, with one round of host work for all of
    # them (Scheduler._plan_burst). For a small model on a GPU, where the host's work per step outlasts the
    # step; tokens then stream in bursts of this many. 1 = off; a speculating or prefill engine keeps 1
    num_scheduler_steps: int = 1
    # vLLM's --stream-interval: a request's new tokens are held until this many are out before they go to its
    # stream (its first and last go at once), so the service sends, and the router formats and writes, one
    # message per this many tokens. 1 = every step's tokens at once. A request's own stream_interval may
    # raise it (SamplingParams)
    stream_interval: int = 1
    # CUDA: replay decode steps from CUDA graphs captured at start (one per padded batch size; one KV
    # block more is allocated for padding rows). False = launch every kernel eagerly (vLLM's --enforce-eager)
    cuda_graphs: bool = True
    # a block pool and tables per KV layer group (KVLayout.groups: sliding layers keep only their window's
    # blocks). False = one group that keeps every block of every layer (the baseline the hybrid cache is
    # measured against)
    kv_layer_groups: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization != "none" and self.device.startswith("cuda"):
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU kernels only")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}")
        if self.spec_method not in SPEC_METHODS:
            raise ValueError(f"spec_method must be one of {SPEC_METHODS}, got {self.spec_method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.spec_method == "eagle" and self.spec_eagle_head is None:
            raise ValueError("spec_method 'eagle' needs spec_eagle_head (a head saved by `baton train-draft`)")
        if self.spec_eagle_window < 1:
            raise ValueError(f"spec_eagle_window must be >= 1, got {self.spec_eagle_window}")
        if self.spec_disable_batch_size is not None and self.spec_disable_batch_size < 1:
            raise ValueError(f"spec_disable_batch_size must be >= 1, got {self.spec_disable_batch_size}")
        if self.spec_tree is not None and self.spec_method != "eagle":
            raise ValueError(f"spec_tree drafts with an EAGLE head: spec_method is {self.spec_method!r}")
        if self.spec_draft_num_layers < 1:
            raise ValueError(f"spec_draft_num_layers must be >= 1, got {self.spec_draft_num_layers}")
        if not 1 <= self.num_scheduler_steps <= 64:
            raise ValueError(f"num_scheduler_steps must be in [1, 64], got {self.num_scheduler_steps}")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}")

    @property
    def precision(self) -> Precision:
        """Weights, KV cache and activations' dtypes, `auto` resolved for the device."""
        return resolve_precision(self.dtype, self.kv_cache_dtype, self.device)

    @property
    def weight_format(self) -> WeightFormat:
        """How the projections are stored (the GGUF codes themselves are read by the loader)."""
        return WeightFormat(self.precision.weights, self.quantization)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the model computes in (activations)."""
        return self.precision.compute
