"""Settings every engine service (prefill, decode) shares.

Each service subclasses this with its own env prefix (`BATON_PREFILL_`,
`BATON_DECODE_`) and parses it once in its `main.py`.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.config import EngineConfig
from shared.engine.request import MAX_STREAM_INTERVAL
from shared.grpc_common import DEFAULT_MAX_MESSAGE_BYTES


class EngineServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    model: str = Field(default="smollm2-135m", description="alias, .gguf file or HF directory")
    host: str = Field(default="127.0.0.1", description="interface the gRPC server binds")
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port; 0 = let the OS pick")
    advertise_host: str = Field(default="", description="host others reach us at; default: `host`")
    metrics_port: int = Field(default=0, ge=-1, le=65535, description="Prometheus port; 0 = any, -1 = off")
    port_file: Path | None = Field(default=None, description="file the bound gRPC port is written to once "
                                   "serving: a health check's way to it when port is 0 (host networking)")
    instance_id: str = Field(default="", description="registry id; default: hostname-random")
    redis_url: str = Field(default="", description="registry; empty = no registration")
    tls_dir: Path | None = Field(default=None, description="mutual TLS on every internal gRPC call: a directory "
                                 "with ca.pem and this service's <service>.pem and <service>-key.pem "
                                 "(`baton certs` makes a set); unset = plaintext")
    internal_token: str = Field(default="", repr=False, description="shared token every internal gRPC call "
                                "carries and every server requires (health checks excepted); empty = open")
    registry_namespace: str = Field(default="baton", description="registry key namespace")
    heartbeat_ttl_s: float = Field(default=6.0, gt=0, description="registry entry lifetime without a beat")
    block_size: int = Field(default=16, ge=1, le=256)
    kv_cache_bytes: int = Field(default=1 << 30, ge=1 << 20, description="KV cache budget in bytes")
    num_kv_blocks: int = Field(default=0, ge=0, description="blocks of the full-attention pool, exactly (sliding "
                               "pools as always); 0 = as many as kv_cache_bytes holds")
    kv_offload_bytes: int = Field(default=0, ge=0, description="host memory for evicted prefix blocks: a "
                                  "preempted request's context comes back from there instead of being "
                                  "recomputed (swap-in); 0 = off")
    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_model_len: int = Field(default=4096, ge=16)
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="float32", description="vLLM's --dtype: on the CPU how weights are stored (activations stay "
        "fp32), on CUDA what the model computes in; auto = the fastest whose fidelity bound holds")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto", description="vLLM's --kv-cache-dtype; auto = the weights' dtype")
    quantization: Literal["none", "int8", "q4_1", "gguf"] = Field(
        default="none", description="vLLM's --quantization: int8 per channel, 4-bit blocks (Q4_1's form) made "
        "at load, or a GGUF model's own blocks")
    torch_threads: int = Field(default=0, ge=0, description="intra-op threads; 0 = torch's default")
    core_share_file: Path | None = Field(default=None, description="a file the engines of one host share: "
                                         "each takes every core while the others have no work, and "
                                         "torch_threads while they have (shared/engine/core_share.py); "
                                         "unset = torch_threads always")
    core_share_slot: int = Field(default=0, ge=0, description="this engine's slot in core_share_file")
    cache_dir: Path = DEFAULT_CACHE_DIR
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=4 << 20)
    aux_hidden_layers: tuple[int, ...] = Field(
        default=(), description="prefill: layers whose outputs travel with the final hidden states (EAGLE-3 "
        "style), e.g. BATON_PREFILL_AUX_HIDDEN_LAYERS='[2, 14, 27]'")
    kv_transfer_timeout_s: float = Field(default=30.0, gt=0, description="deadline of one KV transfer")
    shutdown_grace_s: float = Field(default=10.0, ge=0, description="time requests in flight get on stop")
    log_level: str = "INFO"
    # speculative decoding (decode / colocated roles; a prefill engine ignores these)
    spec: Literal["none", "ngram", "draft", "eagle", "gemma4_assistant"] = Field(default="none",
                                                                               description="proposer")
    num_speculative_tokens: int = Field(default=3, ge=1, le=16, description="draft tokens verified per step")
    spec_draft_model: str | None = Field(default=None, description="draft: model sharing the tokenizer; "
                                         "unset = the target's first spec_draft_num_layers layers; "
                                         "gemma4_assistant: the assistant's HF directory")
    spec_draft_num_layers: int = Field(default=4, ge=1, description="layers of a truncated-target draft")
    spec_eagle_head: Path | None = Field(default=None, description="eagle: head from `baton train-draft`")
    spec_eagle_window: int = Field(default=16, ge=1, description="eagle: hidden-state rows the head drafts over")
    spec_disable_batch_size: int | None = Field(default=None, ge=1, description="steps with more requests "
                                                "decoding than this run without drafts; unset = never")
    spec_tree: str | None = Field(default=None, description="eagle: greedy requests draft this tree of rank "
                                  "paths (e.g. '0;1;0.0;0.0.0') instead of a chain; unset = chains")
    async_scheduling: bool | None = Field(default=None, description="zero-bubble loop: plan step N+1 while "
                                          "step N runs (decode / colocated; draft and eagle keep the synchronous "
                                          "loop); unset = on with CUDA, off on the CPU")
    num_scheduler_steps: int = Field(default=1, ge=1, le=64, description="multi-step decode: steps where every "
                                     "request decodes greedily with nothing reading its logits run up to this "
                                     "many decode steps per round of host work (tokens stream in bursts); 1 = off")
    stream_interval: int = Field(default=1, ge=1, le=MAX_STREAM_INTERVAL, description="vLLM's --stream-interval: "
                                 "a request's tokens go out in messages of this many (its first and last at "
                                 "once); 1 = each step's tokens as they come")
    cuda_graphs: bool = Field(default=True, description="CUDA: replay decode steps and the vision "
                              "encoder (per image-size bucket) from captured CUDA graphs; false = launch kernels "
                              "eagerly")
    grammar_fast_forward: bool = Field(default=True, description="draft the tokens a request's grammar forces "
                                       "next and verify them in one pass (structured outputs)")
    grammar_fast_forward_max_batch: int = Field(default=2, ge=0, description="fast-forward only while at most "
                                                "this many requests decode (larger batches are compute-bound)")

    def engine_config(self, role: str) -> EngineConfig:
        return EngineConfig(
            model=self.model, role=role, block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes,
            num_kv_blocks=self.num_kv_blocks or None,
            kv_offload_bytes=self.kv_offload_bytes,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            device=self.device, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, cache_dir=self.cache_dir,
            quantization=self.quantization,
            spec_method=self.spec, num_speculative_tokens=self.num_speculative_tokens,
            spec_draft_model=self.spec_draft_model, spec_draft_num_layers=self.spec_draft_num_layers,
            spec_eagle_head=self.spec_eagle_head, spec_eagle_window=self.spec_eagle_window,
            spec_disable_batch_size=self.spec_disable_batch_size, spec_tree=self.spec_tree,
            aux_hidden_layers=self.aux_hidden_layers,
            async_scheduling=self.async_scheduling, cuda_graphs=self.cuda_graphs,
            num_scheduler_steps=self.num_scheduler_steps, stream_interval=self.stream_interval,
            grammar_fast_forward=self.grammar_fast_forward,
            grammar_fast_forward_max_batch=self.grammar_fast_forward_max_batch,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def resolved_instance_id(self, service: str) -> str:
        return self.instance_id or f"{service}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
