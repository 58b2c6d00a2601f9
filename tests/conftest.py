"""Switches Triton to its interpreter on machines without CUDA, before any test module is collected.

Triton picks compile-vs-interpret when a `@triton.jit` function is defined, and that includes
triton.language's own helpers (`tl.zeros`, ...), which any import of transformers or torch._dynamo
defines as a side effect. Set it later (in tests/unit/ops' conftest, as it once was) and a test
module collected earlier freezes those helpers compiled: the interpreted kernels then fail with
"Cannot call @triton.jit'd outside of the scope of a kernel". The engine only takes its Triton paths
on CUDA tensors, so interpreting everywhere changes nothing else.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
