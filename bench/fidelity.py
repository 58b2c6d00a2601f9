"""Fidelity of each precision against fp32 on a bundled text set, and the bounds each must hold.

The text (bench/data/fidelity_text.txt: prose, Python and C++) is tokenized once and cut into windows of
`--window` tokens; each window is one fresh sequence through the paged forward (prefill path, with the KV
cache in the precision's dtype). Per precision, over every predicted token:

    mean KL(fp32 || precision)   top-1 agreement with fp32   perplexity (exp of the mean NLL)

Bounds (issue 25): bf16 perplexity within 1% of fp32's; int8 within 2%; 4-bit (the GGUF's own blocks, or
q4_1's made at load) no worse than llama.cpp's perplexity for the same GGUF on the same token windows,
measured in the same run through llama-cpp-python in its own venv (bench/peers/setup_llama_cpp.sh) when
`--llama-cpp VENV` is given.

    .venv/bin/python -m bench.fidelity [--model smollm2-135m] [--window 512] [--llama-cpp ~/.cache/baton/peers/llamacpp-venv]

Writes JSON to bench/results/fidelity-<stamp>.json and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine import log, machine
from bench.results_file import write_results
from bench.serve_report import write_block
from shared.engine.engine import pick_attention
from shared.kv.layout import KVLayout
from shared.models.decoder import DecoderLM
from shared.models.loader import _gguf_file, load_model
from shared.models.weight_format import WeightFormat
from shared.ops.attention import AttentionMetadata
from shared.ops.cpu_isa import best_isa

TEXT = Path(__file__).parent / "data" / "fidelity_text.txt"
# name -> (how projections are stored, KV cache dtype, perplexity bound against fp32 or "llama.cpp")
PRECISIONS: dict[str, tuple[WeightFormat, torch.dtype, Any]] = {
    "float32": (WeightFormat(), torch.float32, None),
    "bfloat16": (WeightFormat(torch.bfloat16), torch.bfloat16, 0.01),
    "bfloat16-weights-fp32-kv": (WeightFormat(torch.bfloat16), torch.float32, 0.01),
    "fp32-weights-bf16-kv": (WeightFormat(), torch.bfloat16, 0.01),
    "int8": (WeightFormat(quantization="int8"), torch.float32, 0.02),
    "int8-bf16-kv": (WeightFormat(quantization="int8"), torch.bfloat16, 0.02),
    # an 8-bit KV cache (--kv-cache-dtype fp8 / fp8_e5m2, no scale) is held to the 8-bit weights' bound
    "fp32-weights-fp8-kv": (WeightFormat(), torch.float8_e4m3fn, 0.02),
    "bfloat16-fp8-kv": (WeightFormat(torch.bfloat16), torch.float8_e4m3fn, 0.02),
    "int8-fp8-kv": (WeightFormat(quantization="int8"), torch.float8_e4m3fn, 0.02),
    "int8-fp8_e5m2-kv": (WeightFormat(quantization="int8"), torch.float8_e5m2, 0.02),
    # 4-bit blocks made at load from the fp32 weights, held to the same bound as the GGUF file's own blocks
    "q4_1": (WeightFormat(quantization="q4_1"), torch.float32, "llama.cpp"),
    "gguf": (WeightFormat(quantization="gguf"), torch.float32, "llama.cpp"),
    "gguf-bf16-kv": (WeightFormat(quantization="gguf"), torch.bfloat16, "llama.cpp"),
}


def window_logprobs(model: DecoderLM, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """log-softmax of the logits at every position of one sequence: [n, vocab] float32."""
    n, block = len(ids), 16
    blocks = -(-n // block)
    kv = KVLayout(model.num_layers, blocks, block, model.num_kv_heads, model.head_dim, kv_dtype).allocate()
    table = torch.arange(blocks)
    pos = torch.arange(n)
    meta = AttentionMetadata(table[pos // block] * block + pos % block, torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), table[None].int(), [n], [n])
    hidden = model.forward(torch.tensor(ids), pos, kv, meta)
    return model.compute_logits(hidden).float().log_softmax(-1)


def measure(model: DecoderLM, windows: list[list[int]], kv_dtype: torch.dtype,
            reference: list[torch.Tensor] | None) -> tuple[dict[str, float], list[torch.Tensor]]:
    """(metrics, per-window log-probs). Against `reference` (fp32's log-probs) KL and top-1 too."""
    nll, kl, agree, count = 0.0, 0.0, 0, 0
    out = []
    for w, ids in enumerate(windows):
        lp = window_logprobs(model, ids, kv_dtype)
        out.append(lp)
        targets = torch.tensor(ids[1:])
        nll -= lp[:-1].gather(1, targets[:, None]).sum().item()
        count += len(ids) - 1
        if reference is not None:
            ref = reference[w][:-1]
            kl += (ref.exp() * (ref - lp[:-1])).sum().item()
            agree += int((ref.argmax(-1) == lp[:-1].argmax(-1)).sum())
    metrics = {"tokens": count, "perplexity": math.exp(nll / count)}
    if reference is not None:
        metrics.update(mean_kl=kl / count, top1_agreement=agree / count)
    return metrics, out


_LLAMA_CPP = """
import json, math, sys
import numpy as np
from llama_cpp import Llama
path, windows = sys.argv[1], json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_ctx=max(map(len, windows)), logits_all=True, n_threads=2, verbose=False)
nll, count = 0.0, 0
for ids in windows:
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    nll -= float(sum(lp[i, ids[i + 1]] for i in range(len(ids) - 1)))
    count += len(ids) - 1
print(json.dumps({"tokens": count, "perplexity": math.exp(nll / count)}))
"""


def llama_cpp_perplexity(venv: Path, gguf: Path, windows: list[list[int]]) -> dict[str, float]:
    """llama.cpp's perplexity of the same GGUF on the same token windows (its own venv, one process)."""
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _LLAMA_CPP, str(gguf)], input=json.dumps(windows),
                          capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def check_bound(name: str, bound: Any, fp32_ppl: float, ppl: float, llama: dict[str, float] | None) -> dict[str, Any]:
    if bound is None:
        return {}
    if bound == "llama.cpp":
        if llama is None:
            return {"bound": "llama.cpp's perplexity (not measured: no --llama-cpp)", "holds": None}
        return {"bound": f"<= llama.cpp's {llama['perplexity']:.4f}", "holds": ppl <= llama["perplexity"]}
    limit = fp32_ppl * (1 + bound)
    return {"bound": f"within {bound:.0%} of fp32 (<= {limit:.4f})", "holds": ppl <= limit}


def readme_table(result: dict[str, Any]) -> str:
    """The README's fidelity table, from one run's JSON."""
    llama = result.get("llama_cpp")
    lines = [f"Fidelity against fp32 ({result['model']}, {result['tokens']} tokens of bench/data/{result['text']} in "
             f"windows of {result['window']}, kernels at {result['isa']}"
             + (f"; llama.cpp's perplexity for the same GGUF: {llama['perplexity']:.4f}" if llama else "")
             + "; bench/fidelity.py):", "",
             "| precision | weights | KV cache | perplexity | mean KL | top-1 agreement | bound | holds |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in result["precisions"].items():
        holds = {True: "yes", False: "**no**", None: "not measured"}.get(m["holds"], "-") if "holds" in m else "-"
        lines.append(f"| {name} | {m['weights']} | {m['kv_cache_dtype']} | {m['perplexity']:.4f} | "
                     f"{m['mean_kl']:.5f} | {m['top1_agreement']:.4f} | {m.get('bound', '-')} | {holds} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--llama-cpp", type=Path, default=None, help="llama-cpp-python venv (4-bit bound)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--readme", action="store_true", help="regenerate bench/README.md's fidelity table")
    args = parser.parse_args()
    torch.set_num_threads(2)
    attention = pick_attention("auto", "cpu")
    fp32 = load_model(args.model, attention, max_model_len=max(args.window, 1024))
    ids = fp32.tokenizer(TEXT.read_text())["input_ids"]
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window) if len(ids[i:i + args.window]) > 1]
    log(f"{len(ids)} tokens of {TEXT.name} in {len(windows)} windows of <= {args.window}")
    llama = None
    if args.llama_cpp is not None:
        t0 = time.monotonic()
        llama = llama_cpp_perplexity(args.llama_cpp, _gguf_file(args.model), windows)
        log(f"llama.cpp on {_gguf_file(args.model).name}: perplexity {llama['perplexity']:.4f} "
            f"({time.monotonic() - t0:.0f} s)")
    base, reference = measure(fp32.model, windows, torch.float32, None)
    results: dict[str, Any] = {}
    for name in args.precisions:
        fmt, kv_dtype, bound = PRECISIONS[name]
        t0 = time.monotonic()
        model = fp32.model if name == "float32" else load_model(
            args.model, attention, max_model_len=max(args.window, 1024), weight_format=fmt).model
        metrics, _ = measure(model, windows, kv_dtype, reference)
        metrics.update(check_bound(name, bound, base["perplexity"], metrics["perplexity"], llama))
        metrics["kv_cache_dtype"] = str(kv_dtype).removeprefix("torch.")
        metrics["weights"] = model.weight_format.describe()  # the loaded one: it names the GGUF's block types
        results[name] = metrics
        log(f"{name}: ppl {metrics['perplexity']:.4f}, KL {metrics['mean_kl']:.5f}, top-1 "
            f"{metrics['top1_agreement']:.4f}, bound {metrics.get('bound', '-')}: {metrics.get('holds', '-')} "
            f"({time.monotonic() - t0:.0f} s)")
    out = {"bench": "fidelity", "model": args.model, "text": TEXT.name, "window": args.window, "tokens": len(ids),
           "isa": best_isa(), "machine": machine(), "llama_cpp": llama, "precisions": results}
    path = write_results(out, args.out, "fidelity")
    log(f"wrote {path}")
    if args.readme:
        write_block(Path(__file__).parent / "README.md", "fidelity", readme_table(out))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
