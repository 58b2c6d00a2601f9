"""The C++ CPU kernels built with other compiler flags, against the repo's build, in one process.

shared/ops/cpu_kernels.py compiles the kernels with `-O3` and the flags its `arch_flags` gives (on x86-64
`-mtune=generic`; its docstring says why). Whether other flags (`-mtune=native`, another -O level, ...) would
serve faster on a machine is measured here. The same sources are built a second time with `--cflags`, their
ops registered under another namespace (torch.ops.baton_cpu_alt) and the layer loop's class renamed
(DecoderLayersAlt): torch keys a custom class by its C++ type, so two libraries cannot both hold
`DecoderLayers`. Both libraries are loaded, and each round times the repo's build and the other in turn, so
the machine's drift reaches both alike:
  - whole decode steps of an engine at each --batch, the model's C++ layer loop taken from one library or
    the other (bench/layer_loop.py's alternation; the LM head, sampling and the rest stay the repo's);
  - the LM head's projection at one row;
  - one pass over every layer projection at 256 rows (a prompt chunk's).
The two libraries' layer loops and projections are first required to give the same bits. Reported: the
median ms each way and the median over rounds of other / repo (above 1: the repo's build is faster). Two
libraries built alike still differ by a few percent (their code lies at other addresses):
`--cflags="-O3 -mtune=generic"` measures that floor on x86-64.

    .venv/bin/python -m bench.kernel_tuning [--cflags "-O3 -mtune=native"] [--precision int8|bf16]
        [--batch 1 8] [--rounds 12]

The second library is built once per flags and sources into the baton cache dir (minutes on two cores).
Writes bench/results/kernel_tuning-<stamp>.json and prints it, less the per-round times, as the last line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.engine import log, machine
from bench.kernel_switch import engine_for
from bench.layer_loop import alternate_decode_steps, end_requests, random_prompts, start_decoding
from bench.results_file import write_results
from shared.engine.request import SamplingParams
from shared.models.cpu_layer_loop import CpuLayerLoop
from shared.ops import cpu_isa
from shared.ops.cpu_kernels import HEADERS, SOURCES, arch_flags

ALT_NAMESPACE = "baton_cpu_alt"
ALT_CLASS = "DecoderLayersAlt"
# the engine's flags per --precision, and the backend its projections then run (an op of the same signature
# in both libraries)
PRECISIONS = {
    "int8": ({"quantization": "int8", "kv_cache_dtype": "bfloat16"}, "w8a8"),
    "bf16": ({"dtype": "bfloat16"}, "gemv_bf16"),
}


def alt_sources(build_dir: Path) -> list[str]:
    """The kernels' sources and headers copied into build_dir/csrc with the ops under ALT_NAMESPACE and the
    layer loop's class renamed, each written only when it changed; every source must register its ops the way
    this rewrites (else it raises)."""
    staged = build_dir / "csrc"
    staged.mkdir(parents=True, exist_ok=True)
    sources = []
    for src in SOURCES + HEADERS:
        text = src.read_text()
        if src.suffix == ".cpp":
            text, n = re.subn(r"\bTORCH_LIBRARY(_FRAGMENT|_IMPL)?\(baton_cpu,", rf"TORCH_LIBRARY\1({ALT_NAMESPACE},",
                              text)
            if n == 0:
                raise RuntimeError(f"{src.name} registers no op under baton_cpu as this bench expects")
            if src.name == "decoder_layers_cpu.cpp":
                text = re.sub(r"\bDecoderLayers\b", ALT_CLASS, text)
            sources.append(str(staged / src.name))
        dst = staged / src.name
        if not dst.exists() or dst.read_text() != text:  # rewritten, torch's ninja would build it all again
            dst.write_text(text)
    return sources


def load_alt(cflags: list[str]) -> None:
    """Build (or reuse) and load the second library."""
    from torch.utils.cpp_extension import load

    from shared.cache_dir import DEFAULT_CACHE_DIR

    key = hashlib.sha1(" ".join(cflags).encode() + b"".join(p.read_bytes() for p in SOURCES + HEADERS))
    build_dir = DEFAULT_CACHE_DIR / "torch_extensions" / f"alt-{torch.__version__}-{key.hexdigest()[:10]}"
    log(f"building the kernels with {' '.join(cflags)} in {build_dir} (minutes the first time) ...")
    t0 = time.monotonic()
    load(name="baton_cpu_kernels_alt", sources=alt_sources(build_dir), extra_cflags=[*cflags, "-fopenmp"],
         build_directory=str(build_dir), is_python_module=False, verbose=False)
    getattr(torch.ops, ALT_NAMESPACE).set_isa(cpu_isa.active_isa())  # the level the repo's library runs at
    log(f"loaded ({time.monotonic() - t0:.0f} s)")


def same_bits(engine: Any, repo: CpuLayerLoop, alt: CpuLayerLoop, batch: int) -> None:
    """Both loops over one decode step's arguments (captured from a real step) give the same tensors."""
    args: list[tuple[Any, ...]] = []
    real_run = repo.run

    def capture(*a: Any) -> Any:
        args.append(a)
        return real_run(*a)

    ids = [f"bits-{i}" for i in range(batch)]
    start_decoding(engine, ids, random_prompts(engine.loaded.spec.vocab_size, batch, 64),
                   SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    repo.run = capture  # type: ignore[method-assign]
    try:
        engine.step()
    finally:
        del repo.run
        end_requests(engine, ids)
    if not args:
        raise RuntimeError("the decode step did not run the C++ layer loop")
    for a, b in zip(repo.run(*args[0]), alt.run(*args[0]), strict=True):
        if not torch.equal(a, b):
            raise RuntimeError(f"the two builds' layer loops differ at batch {batch}")


def ratio_row(key: str, value: Any, repo_s: list[float], alt_s: list[float]) -> dict[str, Any]:
    """Medians (ms) and the median over rounds of other / repo, with its quartiles."""
    ratios = sorted(a / r for r, a in zip(repo_s, alt_s, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {key: value, "repo_ms": round(statistics.median(repo_s) * 1e3, 3),
            "other_ms": round(statistics.median(alt_s) * 1e3, 3), "other_over_repo": round(statistics.median(ratios), 3),
            "quartiles": [round(q[0], 3), round(q[2], 3)],
            "runs": {"repo": [round(t * 1e3, 3) for t in repo_s], "other": [round(t * 1e3, 3) for t in alt_s]}}


def alternate(fns: dict[str, Callable[[], Any]], rounds: int, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each function, in turn every round (the order flipped every other round)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds + 1):  # the first round warms up
        for name in names if r % 2 == 0 else names[::-1]:
            fns[name]()
            t0 = time.perf_counter()
            for _ in range(reps):
                fns[name]()
            if r:
                times[name].append((time.perf_counter() - t0) / reps)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precision", default="int8", choices=sorted(PRECISIONS))
    parser.add_argument("--cflags", default="-O3 -mtune=native", help="the second library's flags")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    flags, backend = PRECISIONS[args.precision]
    engine = engine_for(args.model, flags)  # builds or loads the repo's library first
    load_alt(shlex.split(args.cflags))
    model = engine.loaded.model
    repo_loop = model.cpu_layer_loop
    if repo_loop is None:
        raise SystemExit(f"{args.model} in {args.precision} runs no C++ layer loop here")
    alt_loop = CpuLayerLoop(model, repo_loop.gelu_tanh, getattr(getattr(torch.classes, ALT_NAMESPACE), ALT_CLASS))
    for batch in args.batch:
        same_bits(engine, repo_loop, alt_loop, batch)
    lins = [w for layer in model.layers for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)]
    if any(w.backend != backend for w in [*lins, model.lm_head]):
        raise SystemExit(f"not every projection runs {backend} in {args.precision} here")
    ops = {"repo": getattr(torch.ops.baton_cpu, backend), "other": getattr(getattr(torch.ops, ALT_NAMESPACE), backend)}
    xs = {k: torch.randn(256, k) for k in {w.in_features for w in lins}}
    for w in lins[:4]:
        if not torch.equal(ops["repo"](xs[w.in_features], w.weight, w.out_features),
                           ops["other"](xs[w.in_features], w.weight, w.out_features)):
            raise RuntimeError("the two builds' projections differ")
    log("same bits: layer loops and projections")

    steps = []
    for batch in args.batch:
        def use(loop: CpuLayerLoop) -> Callable[[], None]:
            return lambda: setattr(model, "cpu_layer_loop", loop)

        per_step = alternate_decode_steps(engine, batch, args.rounds, steps=8, prompt_len=256,
                                          variants={"repo": use(repo_loop), "other": use(alt_loop)},
                                          restore=use(repo_loop))
        # a round's figure: the median of its 8 steps
        rounds = {k: [statistics.median(v[i:i + 8]) for i in range(0, len(v), 8)] for k, v in per_step.items()}
        steps.append(ratio_row("batch", batch, rounds["repo"], rounds["other"]))
        log(f"decode step, batch {batch}: x{steps[-1]['other_over_repo']:.3f}")
    head = model.lm_head
    h = torch.randn(1, head.in_features)
    times = alternate({k: (lambda op=op: op(h, head.weight, head.out_features)) for k, op in ops.items()},
                      args.rounds * 2, reps=10)
    lm_head = ratio_row("rows", 1, times["repo"], times["other"])
    log(f"LM head, one row: x{lm_head['other_over_repo']:.3f}")

    def prompt_pass(op: Any) -> Callable[[], None]:
        def run() -> None:
            for w in lins:
                op(xs[w.in_features], w.weight, w.out_features)
        return run

    times = alternate({k: prompt_pass(op) for k, op in ops.items()}, args.rounds, reps=1)
    prompt = ratio_row("rows", 256, times["repo"], times["other"])
    log(f"every projection, 256 rows: x{prompt['other_over_repo']:.3f}")

    result = {"bench": "kernel_tuning", "model": args.model, "precision": args.precision,
              "repo_cflags": ["-O3", *arch_flags()], "other_cflags": shlex.split(args.cflags),
              "isa": cpu_isa.active_isa(), "machine": machine(), "rounds": args.rounds,
              "decode_steps": steps, "lm_head": lm_head, "prompt_projections": prompt}
    log(f"wrote {write_results(result, args.out, 'kernel_tuning')}")
    brief = {k: v for k, v in result.items() if k not in ("decode_steps", "lm_head", "prompt_projections")}
    brief |= {k: ([{a: b for a, b in r.items() if a != "runs"} for r in v] if isinstance(v, list)
                  else {a: b for a, b in v.items() if a != "runs"})
              for k, v in result.items() if k in ("decode_steps", "lm_head", "prompt_projections")}
    print(json.dumps(brief))
    return 0


if __name__ == "__main__":
    sys.exit(main())
