"""Engine configuration: one frozen object, validated once.

Services build it from their pydantic settings; the CLI from its flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.models.loader import DEFAULT_CACHE_DIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    role: str = "colocated"  # colocated | prefill | decode
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # KV budget; ignored when num_kv_blocks is set
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = 8192  # capped at the model's own limit
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"  # auto: Triton on CUDA, torch reference elsewhere
    seed: int = 0
    cache_dir: Path = field(default=DEFAULT_CACHE_DIR)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
