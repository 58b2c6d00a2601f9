"""The decode loop on a CUDA GPU: eager against CUDA graphs, synchronous against zero-bubble.

For each batch size, set of ops (torch's; the Triton kernels of triton_decoder_ops.py between projections; those
and, up to 16 rows, triton_gemv.py's projections with the norms, adds and SiLU gate folded in) and
setup (loop x graphs): decode tokens/s, its fraction of the HBM-bandwidth bound (weights once a step plus the
requests' KV, at a measured device-to-device copy's bandwidth), the GPU's busy fraction while
decoding (kernel time over the span from the first kernel to the last, read
from a torch.profiler trace of a window of steps), and where the host waited
for the GPU (torch's sync debug mode, by the first frame inside `shared/`).
Greedy tokens of every setup with the same ops must be identical (the run fails otherwise); across ops, where
rounding differs, the share of each greedy output that agrees before the first difference is reported.

Weights are random with SmolLM2-135M's shapes (no model hub on a lent GPU
machine; speed does not depend on the values). Writes JSON to bench/results/.

    python bench/cuda_loop.py [--batch 1 8 32] [--dtype bfloat16] [--new-tokens 128] [--ops torch triton gemv]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine, pick_attention
from shared.engine.request import SamplingParams
from shared.models.decoder import DecoderLM
from shared.models.families import spec_from_config
from shared.models.loader import LoadedModel

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    eos_token_id=2, bos_token_id=1)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_loaded(dtype: torch.dtype, num_layers: int, device: str, triton_ops: bool | None = None,
                  triton_gemv: bool | None = None) -> LoadedModel:
    from transformers import LlamaConfig

    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": num_layers})
    spec = spec_from_config(config)
    torch.manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    h, i, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * d
    weights["model.embed_tokens.weight"] = torch.randn(config.vocab_size, h) * 0.5
    weights["model.norm.weight"] = torch.ones(h)
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        for name, shape in [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, h)),
                            ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i))]:
            weights[p + name + ".weight"] = torch.randn(*shape) * shape[1] ** -0.5
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
    model = DecoderLM(spec, weights, pick_attention("auto", device), device=device, dtype=dtype,
                      triton_ops=triton_ops, triton_gemv=triton_gemv)
    return LoadedModel(name="random-smollm2-135m", hf_dir=Path("/nonexistent"), hf_config=config, spec=spec,
                       model=model, tokenizer=None, eos_token_ids=frozenset({2}))


class SyncPoints:
    """Counts host waits on the GPU by the first `shared/` frame that caused them (sync debug mode)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.where: Counter[str] = Counter()
        self._lock = threading.Lock()

    def start(self) -> None:
        if not self.enabled:
            return
        self._old = warnings.showwarning
        warnings.simplefilter("always")

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            frames = [f for f in traceback.extract_stack() if "/shared/" in f.filename]
            key = f"{frames[-1].filename.split('/shared/')[-1]}:{frames[-1].lineno} {frames[-1].line}" \
                if frames else "outside shared/"
            with self._lock:
                self.where[key] += 1

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if not self.enabled:
            return
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._old


def gpu_busy_fraction(prof: Any) -> tuple[float, float]:
    """(kernel time / span from first kernel start to last kernel end, span in ms)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return 0.0, 0.0
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    total = spans[-1][1] - spans[0][0]
    return busy / total, total / 1e3


SETUPS = [("sync", False), ("sync", True), ("async", False), ("async", True)]  # (loop, cuda graphs)


def setup_name(loop: str, graphs: bool) -> str:
    return f"{loop}-{'graphs' if graphs else 'eager'}"


def run_one(loaded: LoadedModel, loop: str, graphs: bool, batch: int, prompt_len: int, new_tokens: int,
            dtype: str, device: str, profile_dir: Path | None = None,
            scheduler_steps: int = 1) -> tuple[dict[str, Any], list[list[int]]]:
    engine = LLMEngine(EngineConfig(model=loaded.name, device=device, dtype=dtype, max_model_len=2048,
                                    kv_cache_bytes=2 << 30, async_scheduling=loop == "async",
                                    cuda_graphs=graphs, max_num_seqs=max(batch, 8),
                                    num_scheduler_steps=scheduler_steps), loaded=loaded)
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, loaded.spec.vocab_size, (prompt_len,), generator=gen).tolist()
               for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm up
    # decode throughput: prefill first, then time the decode steps alone
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(batch)}

    def step() -> int:
        n = 0
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            n += len(out.new_token_ids)
        return n

    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    step()
    while any(r.num_output_tokens < 2 for r in engine.scheduler.running):  # all past prefill, none finished
        step()
    cuda = torch.device(engine.config.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # steps 16-47 run under the profiler and sync debug mode, and are left out of the timing (single steps only:
    # bursts make too few steps for the window)
    window_on = cuda and scheduler_steps == 1
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA]) if window_on else None
    syncs = SyncPoints(window_on)
    steps = window = timed_steps = timed_tokens = 0
    timed_s = 0.0
    sync()
    while engine.has_unfinished():
        profiling = prof is not None and 16 <= steps < 48
        if profiling and steps == 16:
            prof.start()
            syncs.start()
        t0 = time.perf_counter()
        emitted = step()
        if not profiling:
            timed_s += time.perf_counter() - t0
            timed_tokens += emitted
            timed_steps += 1
        steps += 1
        if profiling and steps == 48:
            sync()
            syncs.stop()
            prof.stop()
            window = 32
    sync()
    if prof is not None and profile_dir is not None and window:
        averages = prof.key_averages()
        table = (averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n"
                 + averages.table(sort_by="self_cuda_time_total", row_limit=25))
        ops = "gemv" if loaded.model._gemv else "triton" if loaded.model.triton_ops else "torch"
        ops += "-tuned" if ops == "gemv" and tilings_tuned() else ""
        (profile_dir / f"torch-ops-{ops}-{loop}{'-graphs' if graphs else ''}-b{batch}.txt").write_text(table)
    replay = graph_replay(engine, batch) if graphs and cuda else {}
    engine.close()
    engine.check_no_leaks()
    busy, span_ms = gpu_busy_fraction(prof) if window else (0.0, 0.0)
    row = {
        "loop": loop, "cuda_graphs": graphs, "batch": batch, "decode_steps": steps, "timed_steps": timed_steps,
        "tok_per_s": round(timed_tokens / timed_s, 1), "ms_per_step": round(1e3 * timed_s / timed_steps, 3),
        "gpu_busy_fraction": round(busy, 3), "profiled_steps": window,
        "profiled_ms_per_step": round(span_ms / window, 3) if window else None,
        "host_idle_ratio": round(engine.runner.clock.idle_ratio, 4),
        # the captured forward alone, replayed back to back: the GPU's share of a step (the rest of ms_per_step
        # is the LM head, sampling and whatever of the host's work the loop does not hide), and the host's cost of
        # launching it
        **replay,
        "sync_points": dict(syncs.where.most_common(12)),
    }
    return row, [tokens[f"r{i}"] for i in range(batch)]


def graph_replay(engine: LLMEngine, batch: int, replays: int = 50) -> dict[str, float]:
    """The decode graph that holds `batch` sequences replayed back to back (its inputs are the last step's):
    GPU milliseconds a replay, and host microseconds a launch call (timed before the wait), medians of 5 runs."""
    graphs = engine.runner.graphs
    size = graphs.size_for(batch) if graphs is not None else None
    if graphs is None or size is None or size not in graphs._graphs:
        return {}
    graph = graphs._graphs[size]
    gpu, host = [], []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        host.append((time.perf_counter() - t0) / replays)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / replays)
    return {"graph_replay_ms": round(sorted(gpu)[2], 4), "graph_launch_host_us": round(1e6 * sorted(host)[2], 1)}


def tilings_tuned() -> bool:
    from shared.ops import triton_gemv as tg

    return tg.config_for(1, 576, 576, False) != tg.DEFAULT_CONFIG


def common_prefix_fraction(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Mean over requests of how much of the reference's greedy output this run repeats before it first differs."""
    fractions = []
    for got, want in zip(tokens, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        fractions.append(same / max(len(want), 1))
    return round(sum(fractions) / max(len(fractions), 1), 4)


def weight_bytes(layers: int, itemsize: int) -> int:
    """Bytes of weights a decode step reads: every layer's, the final norm, and the (tied) LM head; the
    embedding lookup reads a row per token."""
    c = {k: int(v) for k, v in SMOLLM2_135M.items() if isinstance(v, int)}
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return itemsize * (layers * per_layer + h + v * h)


def kv_bytes_per_token(layers: int, itemsize: int) -> int:
    c = {k: int(v) for k, v in SMOLLM2_135M.items() if isinstance(v, int)}
    return itemsize * layers * 2 * c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]


def hbm_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read plus written), the median of 5; 0 off CUDA."""
    if not device.startswith("cuda"):
        return 0.0
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / sorted(times[2:])[2]


def _ops_label(row: dict[str, Any]) -> str:
    steps = row.get("scheduler_steps", 1)
    return row.get("ops", "torch") + (f", {steps} steps a burst" if steps > 1 else "")


def report(results: list[dict[str, Any]], names: list[str]) -> str:
    """The README's table of a run (or of runs of one call, one batch size each): per batch and set of ops,
    decode tok/s in each loop (same GPU)."""
    rows = [{**r, "ops": _ops_label(r)} for result in results for r in result["rows"] if "error" not in r]
    ops_order = list(dict.fromkeys(r["ops"] for r in rows))
    result = results[0]
    name = "`, `bench/results/".join(names)
    lines = [
        f"`bench/cuda_loop.py` on an {result['device']} (`bench/results/{name}`; random weights with SmolLM2-135M's "
        f"shapes, {result['dtype']}, {result['prompt_len']}-token prompts, {result['new_tokens']} new tokens; "
        f"device-to-device copy {result.get('hbm_gb_per_s')} GB/s), decode tokens/s:", "",
        "| batch | ops | eager, sync | graphs, sync | graphs, zero-bubble | best loop vs first ops' | GPU busy "
        "| of HBM bound | forward alone (graph replays, ms) | greedy agreement |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for batch in dict.fromkeys(r["batch"] for r in rows):
        cell = {(r["ops"], r["loop"], r["cuda_graphs"]): r for r in rows if r["batch"] == batch}

        def fastest(ops: str, cell: dict[Any, dict[str, Any]] = cell) -> dict[str, Any] | None:
            runs = [r for (o, _, _), r in cell.items() if o == ops]
            return max(runs, key=lambda r: r["tok_per_s"]) if runs else None

        base = fastest(ops_order[0])
        for ops in [o for o in ops_order if fastest(o)]:
            best = fastest(ops)
            assert best is not None

            def tps(loop: str, graphs: bool, ops: str = ops, cell: dict[Any, dict[str, Any]] = cell) -> str:
                r = cell.get((ops, loop, graphs))
                return f"{r['tok_per_s']:.1f}" if r else "-"

            ratio = f"{best['tok_per_s'] / base['tok_per_s']:.2f}x" if base else "-"
            busy = best["gpu_busy_fraction"] if best.get("profiled_steps") else "-"
            lines.append(
                f"| {batch} | {ops} | {tps('sync', False)} | {tps('sync', True)} | {tps('async', True)} | {ratio} "
                f"| {busy} | {best.get('fraction_of_hbm_bound', '-')} | {best.get('graph_replay_ms', '-')} "
                f"| {best.get('agreement_with_first_ops', 1.0)} |")
    return "\n".join(lines)


def profile_host(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """Where the host's step time goes in the synchronous loop with CUDA graphs, at --profile-host-batch: first
    each phase of a step timed alone (scheduling, preparing inputs, executing, reading the outputs; a wrapper's
    clock costs a microsecond), then a cProfile of the same steps."""
    import cProfile
    import io
    import pstats

    batch = args.profile_host_batch
    engine = LLMEngine(EngineConfig(model=loaded.name, device=args.device, dtype=args.dtype, max_model_len=2048,
                                    kv_cache_bytes=1 << 30, async_scheduling=False, cuda_graphs=True,
                                    max_num_seqs=max(batch, 8)), loaded=loaded)
    prompts = [[5 + i] * args.prompt_len for i in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm up
    phases: dict[str, float] = {}

    def timed(owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)

    for owner, name in [(engine.scheduler, "schedule"), (engine.runner, "prepare"), (engine.runner, "execute"),
                        (engine, "_resolve"), (engine.scheduler, "update")]:
        timed(owner, name)
    if engine.runner.graphs is not None:
        timed(engine.runner.graphs, "run")
    timed(engine.runner.model, "compute_logits")
    timed(engine.runner, "_sample")
    report = []
    for label, profiler in [("phases", None), ("cProfile", cProfile.Profile())]:
        for i, p in enumerate(prompts):
            engine.add_request(f"{label}{i}", p, SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True))
        engine.step()
        engine.step()
        phases.clear()
        steps = 0
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        if profiler is not None:
            profiler.disable()
        wall = time.perf_counter() - t0
        report.append(f"{label}: {steps} steps, {1e3 * wall / steps:.3f} ms a step; us a step by phase "
                      "(nested: execute holds graphs.run, _sample, compute_logits; _resolve holds update): "
                      + json.dumps({k: round(1e6 * v / steps, 1) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}))
        if profiler is not None:
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(35)
            stats.sort_stats("cumulative").print_stats(35)
            report.append(text.getvalue())
    engine.close()
    out = "\n".join(report)
    (args.out / f"host-profile-b{batch}-{args.layers}-layers.txt").write_text(out)
    log(out[:3000])


def best_decode_tiling(result: dict[str, Any]) -> Any:
    """The attention_tune tiling with the least geometric mean of its time over the default's, over all cases."""
    import math

    from shared.ops.triton_attention import DecodeTiling

    fields = ("block_n", "num_warps", "num_stages")
    scores: dict[tuple[Any, ...], list[float]] = {}
    for point in result["points"]:
        default = next((t["us"] for t in point["tilings"] if "us" in t), None)
        for t in point["tilings"]:
            if "us" in t and default:
                scores.setdefault(tuple(t[f] for f in fields), []).append(math.log(t["us"] / default))
    cases = max((len(v) for v in scores.values()), default=0)
    complete = {k: sum(v) / len(v) for k, v in scores.items() if len(v) == cases}
    return DecodeTiling(*min(complete, key=lambda k: complete[k])) if complete else None


def gemv_tilings(args: argparse.Namespace) -> Callable[[str], AbstractContextManager[None]]:
    """For a set of ops, the tilings it runs under: "gemv" the untuned ones (the tensor-core GEMV tiling at every
    row count, decode attention in prefill's tiles), "gemv-tuned" --gemv-tuned's and --attention-tuned's fastest
    (default: the committed table for this GPU and the measured decode rule); other ops leave both alone."""
    if "gemv" not in args.ops and "gemv-tuned" not in args.ops:
        return lambda ops: nullcontext()
    from bench.gemv_tune import SHAPES
    from shared.ops import triton_attention as ta
    from shared.ops import triton_gemv as tg

    untuned = {(n, k, "gated" in fold, rows): tg.DEFAULT_CONFIG for _, n, k, fold in SHAPES for rows in (1, 8, 16)}
    tuned = tg.tuned_table(json.loads(args.gemv_tuned.read_text())["best"]) if args.gemv_tuned else None
    attention = best_decode_tiling(json.loads(args.attention_tuned.read_text())) if args.attention_tuned else None
    if attention is not None:
        log(f"gemv-tuned ops: decode attention in {attention}")

    @contextmanager
    def tilings(ops: str) -> Iterator[None]:
        if not ops.startswith("gemv"):
            yield
            return
        old = tg.use_tuned_table(untuned if ops == "gemv" else tuned)
        old_attention = ta.use_decode_tiling(ta.DecodeTiling() if ops == "gemv" else attention)
        try:
            yield
        finally:
            tg.use_tuned_table(old)
            ta.use_decode_tiling(old_attention)

    return tilings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    parser.add_argument("--setups", nargs="+", choices=[setup_name(*s) for s in SETUPS],
                        default=[setup_name(*s) for s in SETUPS],
                        help="loops to run (the first is each set of ops' baseline for equal tokens)")
    parser.add_argument("--ops", nargs="+", choices=["torch", "triton", "gemv", "gemv-tuned"],
                        default=["torch", "triton", "gemv"],
                        help="the layers' elementwise ops: torch's, the Triton kernels, or those and the GEMV "
                             "kernel for batches up to 16, untuned (the tensor-core tiling throughout, decode "
                             "attention in prefill's tiles) or tuned (the first is the baseline)")
    parser.add_argument("--scheduler-steps", type=int, nargs="+", default=[1],
                        help="num_scheduler_steps values to run each setup with (multi-step decode; greedy tokens "
                             "must equal the first's)")
    parser.add_argument("--gemv-tuned", type=Path,
                        help="a bench/gemv_tune.py result whose fastest tilings the gemv-tuned ops take (default: "
                             "shared/ops/triton_gemv_tuned.json's for this GPU)")
    parser.add_argument("--attention-tuned", type=Path,
                        help="a bench/attention_tune.py result: the gemv-tuned ops also launch decode attention in "
                             "the tiling fastest over all its cases (geometric mean against the default)")
    parser.add_argument("--profile-host-batch", type=int, default=8)
    parser.add_argument("--profile-host", action="store_true",
                        help="also write where the host's time goes (cProfile of the synchronous loop, "
                             "torch op table) beside the JSON")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--report", type=Path, nargs="+",
                        help="write the README table of these result JSONs and exit (runs go on a lent GPU; "
                             "the table is made where the repo is)")
    parser.add_argument("--report-block", default="cuda_loop",
                        help="the README block the table replaces (cuda_loop: ops and tilings; "
                             "cuda_loop_steps: multi-step decode)")
    args = parser.parse_args()
    if args.report:
        from bench.serve_report import write_block

        table = report([json.loads(path.read_text()) for path in args.report], [path.name for path in args.report])
        for readme in (Path(__file__).parent / "README.md", Path(__file__).parent.parent / "README.md"):
            write_block(readme, args.report_block, table)
        print(table)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/cuda_loop.py needs a CUDA device (or --device cpu for a smoke run)")
    from shared.engine.precision import DTYPES

    # the same random weights; the layers' elementwise ops in torch or as Triton kernels (triton_decoder_ops.py),
    # and with those the few-row projections as Triton GEMVs with the ops around them folded in (triton_gemv.py)
    models = {}
    for ops in args.ops:
        models[ops] = random_loaded(DTYPES[args.dtype], args.layers, args.device, triton_ops=ops != "torch",
                                    triton_gemv=ops.startswith("gemv"))
    tilings = gemv_tilings(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile_host:
        profile_host(models[args.ops[-1]], args)
    hbm = hbm_bandwidth(args.device)
    step_bytes = weight_bytes(args.layers, DTYPES[args.dtype].itemsize)
    kv_bytes = kv_bytes_per_token(args.layers, DTYPES[args.dtype].itemsize)
    context = args.prompt_len + args.new_tokens / 2  # the mean over the timed steps
    rows = []
    setups = [(loop, graphs) for loop, graphs in SETUPS if setup_name(loop, graphs) in args.setups
              and (args.device.startswith("cuda") or not graphs)]
    for batch in args.batch:
        first: dict[str, tuple[dict[str, Any], list[list[int]]]] = {}
        for ops, loaded in models.items():
            for (loop, graphs), steps in itertools.product(setups, args.scheduler_steps):
                # the op table of batch 1 in the zero-bubble loop with graphs only (files back from a lent GPU
                # are few)
                tables = args.out if args.profile_host and loop == "async" and graphs and batch == 1 \
                    and steps == args.scheduler_steps[0] else None
                try:
                    with tilings(ops):
                        row, tokens = run_one(loaded, loop, graphs, batch, args.prompt_len, args.new_tokens,
                                              args.dtype, args.device, tables, steps)
                except Exception as e:  # one set of ops failing (a kernel that does not compile) spoils no other
                    log(f"{ops} {loop} graphs={graphs} batch {batch}: {traceback.format_exc()}")
                    rows.append({"ops": ops, "loop": loop, "cuda_graphs": graphs, "batch": batch,
                                 "scheduler_steps": steps, "error": repr(e)})
                    continue
                row["ops"] = ops
                row["scheduler_steps"] = steps
                baseline = first.setdefault(ops, (row, tokens))
                reference = next(iter(first.values()))  # the first ops' synchronous eager loop
                # bit-equal within one set of ops; across them the rounding differs, so greedy paths may part
                row["tokens_equal_baseline"] = tokens == baseline[1]
                row["agreement_with_first_ops"] = common_prefix_fraction(tokens, reference[1])
                row["speedup_vs_baseline"] = round(row["tok_per_s"] / reference[0]["tok_per_s"], 3)
                if hbm:  # the weights once a step plus each request's KV: the bytes a step cannot avoid reading
                    bound = batch * hbm / (step_bytes + batch * context * kv_bytes)
                    row["hbm_bound_tok_per_s"] = round(bound, 1)
                    row["fraction_of_hbm_bound"] = round(row["tok_per_s"] / bound, 4)
                log(json.dumps(row))
                rows.append(row)
    result = {
        "bench": "cuda_loop",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device, "torch": torch.__version__,
        "dtype": args.dtype, "layers": args.layers, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "baseline": f"synchronous loop, eager launches, {args.ops[0]} ops",
        "hbm_gb_per_s": round(hbm / 1e9, 1) if hbm else None, "weight_bytes_per_step": step_bytes,
        "kv_bytes_per_token": kv_bytes, "rows": rows,
    }
    path = args.out / f"cuda_loop-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    if not all(r.get("tokens_equal_baseline") for r in rows):
        sys.exit("a setup failed, or its tokens differ from the synchronous eager loop's with the same ops")


if __name__ == "__main__":
    main()
