"""The C++ CPU kernels (`csrc/*.cpp`, ops under `torch.ops.baton_cpu`), built once per machine.

They are compiled with the C++ compiler torch uses (about 2 minutes on two cores, cached under
the baton cache dir; `.ci/run` installs g++): `make run` and `make test` build
them up front (`python -m shared.ops.cpu_kernels`), and otherwise the first
use does. Where they do not build, every caller falls back to its torch path
and the reason is logged once.

An image carries them prebuilt, and no compiler (deploy/docker/Dockerfile):

    python -m shared.ops.cpu_kernels --prebuilt      (at image build, where the package is installed)
      -> shared/ops/prebuilt/{baton_cpu_kernels.so, stamp.json}   portable: the baseline ISA on x86-64
    _build()  stamp == this package's sources + torch + machine ?  torch.ops.load_library(.so)
                                                         else   compile into the cache dir (as before)
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = [_CSRC / name for name in ("cpu_isa.cpp", "paged_decode_cpu.cpp", "gemv_cpu.cpp", "gemv_bf16_cpu.cpp",
                                     "qgemv_cpu.cpp", "w8a8_cpu.cpp", "norm_rope_cpu.cpp",
                                     "silu_mul_cpu.cpp", "write_kv_cpu.cpp", "decoder_layers_cpu.cpp",
                                     "moe_cpu.cpp", "prefill_attention_cpu.cpp", "argmax_cpu.cpp")]
HEADERS = sorted(_CSRC.glob("*.h"))
PREBUILT_DIR = Path(__file__).parent / "prebuilt"
_LIBRARY = "baton_cpu_kernels.so"
# names the instruction-set level to run at, below the best (shared/ops/cpu_isa.py)
ISA_ENV = "BATON_CPU_ISA"
# "0": attention over a bf16 or fp8 cache keeps its fp32 passes where the level has vdpbf16ps ones
ATTENTION_BF16_ENV = "BATON_CPU_ATTENTION_BF16"
_lock = threading.Lock()
_built: bool | None = None


def _build_dir() -> Path:
    from shared.cache_dir import DEFAULT_CACHE_DIR

    # keyed by the sources' contents only: they are compiled from a copy inside the directory (see
    # _staged_sources), so checkouts (worktrees, branches) with the same sources share one build
    key = hashlib.sha1(b"".join(src.name.encode() + src.read_bytes() for src in SOURCES + HEADERS))
    return DEFAULT_CACHE_DIR / "torch_extensions" / f"torch-{torch.__version__}-{_cpu_tag()}-src-{key.hexdigest()[:10]}"


def _staged_sources(build_dir: Path) -> list[str]:
    """The sources (and the headers they include) copied into the build directory, rewritten only when they
    differ: torch's build files name the sources' paths, so compiling a checkout's own files would make
    another checkout with the same sources rebuild over its library."""
    staged = build_dir / "csrc"
    staged.mkdir(exist_ok=True)
    for src in SOURCES + HEADERS:
        dst = staged / src.name
        data = src.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            dst.write_bytes(data)
    return [str(staged / src.name) for src in SOURCES]


def _cpu_flags() -> str:
    """The CPU's flags line from /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_has_avx512() -> bool:
    """Whether the CPU has AVX-512 (the kernels then pick wider paths; see csrc/cpu_isa.h)."""
    return "avx512f" in _cpu_flags().split()


def _x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def arch_flags(portable: bool = False) -> list[str]:
    """On x86-64 the library is built for the baseline and tuned for no CPU in particular: the kernels that
    use newer instructions are compiled per level inside it (csrc/isa_variants.h) and picked at load.
    Elsewhere -march=native builds the portable loops for what the CPU has; a portable build (an image's)
    is built for the architecture's baseline.

    Not -mtune=native: on Zen 3 (AVX2) GCC 12's znver3 tuning laid the batch-1 W8A8 loop out slower, with the
    same instructions. bench/kernel_tuning.py (both builds in one process, SmolLM2 in int8 with a bf16 KV
    cache, median of paired rounds, znver3-tuned time over generic), kernel_tuning-20261207-231714 and
    -232701: batch-1 decode steps x1.076 and x1.054, the LM head at one row x1.122 and x1.122; batch-8 steps
    x1.031 and x1.005 and 256-row projections x0.922 and x0.967, inside the few percent two libraries
    built alike differ by. Generic is also what an image's library always had: a local build now runs the
    code an image ships."""
    if _x86_64():
        return ["-mtune=generic"]
    return [] if portable else ["-march=native"]


def sources_stamp() -> dict[str, str]:
    """What a prebuilt library must have been built from to load here: these sources, this torch, this
    machine architecture."""
    digest = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS)).hexdigest()
    return {"sources_sha256": digest, "torch": torch.__version__, "machine": platform.machine().lower()}


def _cpu_tag() -> str:
    """The build is tuned for the CPU (or, off x86-64, built for it): a home directory shared between two
    machines keeps one library per CPU."""
    return "cpu-" + hashlib.sha1((_cpu_flags() or platform.processor()).encode()).hexdigest()[:10]


def cpu_kernels_available() -> bool:
    """Build (once per process; the compiled library is cached on disk) and load the kernels."""
    global _built
    if _built is not None:  # every layer of every step asks: no lock once settled
        return _built
    with _lock:
        if _built is None:
            _built = _build()
        return _built


def _compile(build_dir: Path, portable: bool = False) -> None:
    """Compile (or reuse torch's up-to-date build in `build_dir`) and load the library."""
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    # -fopenmp only compiles at::parallel_for's pragmas: the symbols come from torch's own libgomp
    # torch rebuilds when a source or a flag changes, never for a header: the headers' hash is a flag
    headers = hashlib.sha1(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:12]
    # torch's own lock is a file that a build killed midway (Ctrl-C, OOM) leaves behind, and every later
    # build then waits on it forever; ours is an flock, released by the kernel when its holder dies, so
    # holding it means nobody else is building here and torch's leftover can go
    with open(build_dir / "baton-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        load(name="baton_cpu_kernels", sources=_staged_sources(build_dir),
             extra_cflags=["-O3", *arch_flags(portable), "-fopenmp", f"-DBATON_CSRC_HEADERS={headers}"],
             build_directory=str(build_dir), is_python_module=False, verbose=False)


def _load_prebuilt(prebuilt_dir: Path = PREBUILT_DIR) -> bool:
    """Load the library an image build left beside these sources, when its stamp matches them."""
    library, stamp_path = prebuilt_dir / _LIBRARY, prebuilt_dir / "stamp.json"
    if not library.is_file() or not stamp_path.is_file():
        return False
    stamp = json.loads(stamp_path.read_text())
    if stamp != sources_stamp():
        logger.warning("prebuilt CPU kernels in %s were built from other sources or another torch (%s): "
                       "compiling", prebuilt_dir, stamp)
        return False
    torch.ops.load_library(str(library))
    logger.info("CPU kernels: prebuilt %s", library)
    return True


def _build() -> bool:
    try:
        if not _load_prebuilt():
            build_dir = _build_dir()
            logger.info("building the CPU kernels (cached in %s)", build_dir)
            _compile(build_dir)
    except Exception as exc:  # no compiler, headers, ...: serve with the torch paths
        logger.warning("CPU kernels unavailable (%s): using the torch paths", exc)
        return False
    _pick_isa(os.environ.get(ISA_ENV, ""))
    if os.environ.get(ATTENTION_BF16_ENV, "1") == "0":  # fp32 sums of the widened cache: slower
        torch.ops.baton_cpu.paged_decode_bf16(False)
        torch.ops.baton_cpu.prefill_attention_bf16(False)
        logger.info("CPU kernels: attention over a bf16 or fp8 cache in fp32 (%s=0)", ATTENTION_BF16_ENV)
    return True


def _pick_isa(level: str) -> None:
    """Run at the best level, or at the one BATON_CPU_ISA names (oneDNN's ONEDNN_MAX_CPU_ISA in spirit: to
    compare levels served, or to step around one); a level this CPU cannot run is refused, not run."""
    best = torch.ops.baton_cpu.best_isa()
    if not level:
        logger.info("CPU kernels: instruction set %s (the best this CPU runs)", best)
        return
    try:
        torch.ops.baton_cpu.set_isa(level)
    except RuntimeError as exc:
        raise ValueError(f"{ISA_ENV}={level}: {str(exc).splitlines()[0]}") from None
    logger.info("CPU kernels: instruction set %s (%s; the best this CPU runs is %s)", level, ISA_ENV, best)


def write_prebuilt(out_dir: Path = PREBUILT_DIR) -> Path:
    """Compile a portable library and leave it with its stamp in `out_dir` (an image build does this once)."""
    with tempfile.TemporaryDirectory(prefix="baton-kernels-") as tmp:
        _compile(Path(tmp), portable=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(tmp) / _LIBRARY, out_dir / _LIBRARY)
    (out_dir / "stamp.json").write_text(json.dumps(sources_stamp(), indent=1) + "\n")
    return out_dir / _LIBRARY


def main(argv: list[str] | None = None) -> int:
    """`make run` / `make test` build them up front, not inside a service's start-up; an image build
    writes them prebuilt (`--prebuilt [DIR]`)."""
    parser = argparse.ArgumentParser(description="build the C++ CPU kernels")
    parser.add_argument("--prebuilt", nargs="?", const=PREBUILT_DIR, type=Path, default=None, metavar="DIR",
                        help=f"write a portable library and its stamp to DIR (default {PREBUILT_DIR})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    if args.prebuilt is not None:
        library = write_prebuilt(args.prebuilt)
        print(f"CPU kernels written to {library} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        return 0
    ok = cpu_kernels_available()
    print(f"CPU kernels {'ready' if ok else 'unavailable: serving uses the torch paths'} "
          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
