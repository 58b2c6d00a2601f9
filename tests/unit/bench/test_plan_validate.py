"""bench/plan_validate.py's pieces that need no server: the trace as requests, the errors, the table."""

from __future__ import annotations

from bench.plan_validate import (
    FIGURES,
    bracketed,
    capped_trace,
    compare,
    fit_probe,
    readme_table,
    request_rows,
    trace_specs,
)
from bench.serve_stats import RequestRecord
from shared.planner.sim_engine import SimRequest


def test_trace_specs_have_exact_lengths_and_shared_prefixes() -> None:
    trace = capped_trace(1.0, 30, seed=0, max_prompt=128, max_output=16)
    specs = trace_specs(trace, list(range(1000, 2000)), seed=0)
    for r, spec in zip(trace, specs, strict=True):
        assert len(spec.body["prompt"]) == r.prompt_tokens <= 128
        assert spec.body["max_tokens"] == spec.body["min_tokens"] == r.output_tokens <= 16
        assert spec.body["ignore_eos"]
    pairs = [(a, b) for a in range(len(trace)) for b in range(a) if trace[a].prefix_group == trace[b].prefix_group]
    assert pairs  # chat requests open with one of 4 system prompts
    for a, b in pairs:
        shared = min(trace[a].prefix_tokens, trace[b].prefix_tokens)
        assert shared > 0 and specs[a].body["prompt"][:shared] == specs[b].body["prompt"][:shared]


def test_compare_and_table() -> None:
    predicted = dict.fromkeys(FIGURES, 110.0)
    measured = dict.fromkeys(FIGURES, 100.0)
    figures = compare(predicted, measured)
    assert figures["p99_ttft_ms"] == {"predicted": 110.0, "measured": 100.0, "error": 0.1}
    result = {"profile_file": "p.json", "max_prompt": 256, "max_output": 32, "requests": 8, "file": "x.json",
              "slo": {"ttft_s": 3.0, "tpot_s": 0.3}, "machine": {"loadavg_at_start": [1.0]},
              "points": [{"shape": "1P1D", "rate": 0.2, "figures": figures}]}
    table = readme_table(result)
    assert "| 1P1D | 0.2 | 110 / 100 (+10%)" in table
    assert "Points within 15%: 5 of 5." in table


def test_the_probe_separates_a_fixed_overhead_from_the_speeds() -> None:
    """Served probes at 64 and 256 tokens that took 40 ms more than 1.2x the prediction, decoding 1.1x slower."""
    predicted = {64: (0.100, 0.020), 256: (0.400, 0.021)}
    rows = [{"prompt_tokens": n, "ttft_s": 0.040 + 1.2 * predicted[n][0] + jitter, "tpot_s": 1.1 * predicted[n][1]}
            for n in (64, 256) for jitter in (-0.002, 0.0, 0.003)]
    fit = fit_probe(rows, predicted)
    assert fit == {"router_overhead_s": 0.04, "prefill_scale": 1.2, "decode_scale": 1.1}
    slower = [{**r, "ttft_s": 10 * r["ttft_s"]} for r in rows]
    assert fit_probe(slower, predicted)["prefill_scale"] == 2.0  # held to 2x: a probe is no licence to refit


def test_probes_before_and_after_a_trace_are_averaged() -> None:
    before = {"rows": [], "router_overhead_s": 0.01, "prefill_scale": 1.0, "decode_scale": 1.2}
    after = {"rows": [], "router_overhead_s": 0.03, "prefill_scale": 1.5, "decode_scale": 0.9}
    assert bracketed(before, after) == {"router_overhead_s": 0.02, "prefill_scale": 1.25, "decode_scale": 1.05}
    assert bracketed(before, None) is before  # a run from before the probe after each trace


def test_the_table_counts_the_probe_before_alone_beside_the_bracketed_one() -> None:
    good = compare(dict.fromkeys(FIGURES, 105.0), dict.fromkeys(FIGURES, 100.0))
    bad = compare(dict.fromkeys(FIGURES, 150.0), dict.fromkeys(FIGURES, 100.0))
    result = {"profile_file": "p.json", "max_prompt": 256, "max_output": 32, "requests": 8, "file": "x.json",
              "slo": {"ttft_s": 3.0, "tpot_s": 0.3}, "machine": {"loadavg_at_start": [1.0]},
              "points": [{"shape": "1P1D", "rate": 0.2, "figures": bad, "figures_probed": good,
                          "figures_probed_before": bad}]}
    table = readme_table(result)
    assert "served alone before and after each rate's trace; every trace point held out): 5 of 5 within 15%." in table
    assert "With the probe before each trace alone: 0 of 5." in table


def test_request_rows_put_each_measured_request_beside_its_simulated_run() -> None:
    trace = capped_trace(1.0, 3, seed=0, max_prompt=128, max_output=16)
    records, simulated = [], []
    for i, t in enumerate(trace):
        n = t.output_tokens
        # measured: first token 0.2 s after the send, then 25 ms a token; simulated: 0.1 s, then 20 ms
        records.append(RequestRecord(sent_s=10.0 + i, token_times_s=[10.2 + i + 0.025 * k for k in range(n)],
                                     output_tokens=n))
        simulated.append(SimRequest(i, t.arrival_s, t.prompt_tokens, n, first_token_s=t.arrival_s + 0.1,
                                    token_times_s=[t.arrival_s + 0.1 + 0.02 * k for k in range(n)]))
    records[1] = RequestRecord(sent_s=11.0, error="HTTP 500")
    rows = request_rows(trace, records, simulated)
    assert [r["prompt_tokens"] for r in rows] == [t.prompt_tokens for t in trace]
    assert rows[0]["ttft_ms"] == 200.0 and rows[0]["predicted_ttft_ms"] == 100.0
    assert rows[0]["tpot_ms"] == 25.0 and rows[0]["predicted_tpot_ms"] == 20.0
    assert rows[1]["ttft_ms"] is None and rows[1]["tpot_ms"] is None and rows[1]["predicted_ttft_ms"] == 100.0
