"""Which instruction-set level the C++ CPU kernels run at: one dispatch table per level.

    portable ─► avx2 ─► avx512 ─► avx512_bf16 ─► amx        (each needs what the one before it needs)

Every kernel with an ISA-specific form is compiled once per level into the same
library (`csrc/isa_variants.h`), so a machine runs, and its tests check, every
level up to its best. The best level the CPU and OS support is picked when the
library loads and logged once; `use_isa` picks a lower one for a test or a
benchmark, and `BATON_CPU_ISA=<level>` one for a whole process (a server
compared at two levels; shared/ops/cpu_kernels.py). `csrc/cpu_isa.h` lists
what each level adds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shared.ops.cpu_kernels import cpu_kernels_available

logger = logging.getLogger(__name__)

ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16", "amx")
# what a level needs beyond the one before it, as a skip reason names it
ISA_NEEDS = {
    "portable": "",
    "avx2": "AVX2, FMA and F16C",
    "avx512": "AVX-512 F/BW/VL/DQ",
    "avx512_bf16": "AVX512-BF16 and AVX512-VNNI",
    "amx": "AMX-TILE, AMX-BF16 and AMX-INT8",
}


def _ops() -> torch._ops._OpNamespace:
    if not cpu_kernels_available():
        raise RuntimeError("the C++ CPU kernels did not build (see the log)")
    return torch.ops.baton_cpu


def best_isa() -> str:
    """The best level this CPU (and OS) runs."""
    return str(_ops().best_isa())


def active_isa() -> str:
    """The level the kernels run at now."""
    return str(_ops().active_isa())


def isa_supported(level: str) -> bool:
    if level not in ISA_LEVELS:
        raise ValueError(f"unknown instruction-set level {level!r}: one of {ISA_LEVELS}")
    return bool(_ops().isa_supported(level))


def isa_at_least(level: str) -> bool:
    """Whether the active level is `level` or above."""
    return ISA_LEVELS.index(active_isa()) >= ISA_LEVELS.index(level)


def missing_for(level: str) -> str:
    """Why this CPU cannot run `level` ("" where it can): 'needs <the instructions>'."""
    if isa_supported(level):
        return ""
    first_missing = ISA_LEVELS[ISA_LEVELS.index(best_isa()) + 1]
    return f"needs {ISA_NEEDS[first_missing]} (this CPU runs up to {best_isa()})"


@contextmanager
def use_isa(level: str) -> Iterator[None]:
    """Run the kernels at `level` inside the block (tests, benchmarks); the CPU must support it."""
    before = active_isa()
    _ops().set_isa(level)
    try:
        yield
    finally:
        _ops().set_isa(before)
