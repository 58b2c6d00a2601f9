"""The CPU kernels' dispatch by instruction-set level (shared/ops/cpu_isa.py, csrc/cpu_isa.cpp)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.ops import cpu_isa
from shared.ops.cpu_kernels import ISA_ENV


def test_the_best_level_is_active_and_every_level_below_it_is_supported() -> None:
    best = cpu_isa.best_isa()
    assert cpu_isa.active_isa() == best
    rank = cpu_isa.ISA_LEVELS.index(best)
    assert [cpu_isa.isa_supported(level) for level in cpu_isa.ISA_LEVELS] == [
        i <= rank for i in range(len(cpu_isa.ISA_LEVELS))]
    assert cpu_isa.missing_for(best) == "" and cpu_isa.isa_supported("portable")


def test_the_best_level_matches_the_cpu_flags() -> None:
    """cpuid and xgetbv in C++ against what Linux reports in /proc/cpuinfo."""
    from shared.ops.cpu_kernels import _cpu_flags, _x86_64

    if not _x86_64():
        assert cpu_isa.best_isa() == "portable"
        return
    flags = set(_cpu_flags().split())
    if not {"avx2", "fma", "f16c"} <= flags:
        expected = "portable"
    elif not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        expected = "avx2"
    elif not {"avx512_bf16", "avx512_vnni"} <= flags:
        expected = "avx512"
    elif not {"amx_tile", "amx_bf16", "amx_int8"} <= flags:
        expected = "avx512_bf16"
    else:
        expected = "amx"
    assert cpu_isa.best_isa() == expected


def test_use_isa_switches_and_restores(isa_level: str) -> None:
    assert cpu_isa.active_isa() == isa_level
    with cpu_isa.use_isa("portable"):
        assert cpu_isa.active_isa() == "portable" and not cpu_isa.isa_at_least("avx2")
    assert cpu_isa.active_isa() == isa_level and cpu_isa.isa_at_least(isa_level)


def test_a_level_the_cpu_lacks_is_refused_and_an_unknown_one_named() -> None:
    missing = [level for level in cpu_isa.ISA_LEVELS if not cpu_isa.isa_supported(level)]
    for level in missing:
        with pytest.raises(RuntimeError, match="this CPU runs"):
            with cpu_isa.use_isa(level):
                pass
        assert cpu_isa.missing_for(level).startswith("needs ")
    with pytest.raises(ValueError, match="unknown"):
        cpu_isa.isa_supported("sse9")
    assert cpu_isa.active_isa() == cpu_isa.best_isa()


def _level_in_a_fresh_process(env_level: str) -> subprocess.CompletedProcess[str]:
    code = ("from shared.ops.cpu_kernels import cpu_kernels_available; import torch; "
            "assert cpu_kernels_available(); print(torch.ops.baton_cpu.active_isa())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, ISA_ENV: env_level}, cwd=Path(__file__).parents[3])


def test_baton_cpu_isa_picks_a_lower_level_and_refuses_one_the_cpu_lacks() -> None:
    below = cpu_isa.ISA_LEVELS[max(0, cpu_isa.ISA_LEVELS.index(cpu_isa.best_isa()) - 1)]
    run = _level_in_a_fresh_process(below)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == below
    refused = _level_in_a_fresh_process("sse9")
    assert refused.returncode != 0 and f"{ISA_ENV}=sse9: unknown instruction-set level" in refused.stderr
    missing = [level for level in cpu_isa.ISA_LEVELS if not cpu_isa.isa_supported(level)]
    if missing:
        refused = _level_in_a_fresh_process(missing[0])
        assert refused.returncode != 0 and "this CPU runs the CPU kernels up to" in refused.stderr
