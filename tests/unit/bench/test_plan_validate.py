"""bench/plan_validate.py's pieces that need no server: the trace as requests, the errors, the table."""

from __future__ import annotations

from bench.plan_validate import FIGURES, capped_trace, compare, readme_table, trace_specs


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
