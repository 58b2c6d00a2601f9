"""bench/kernel_switch.py: the off/on alternation the switch benches share, on a real switch and a real
projection (tiny, so that it runs in a second)."""

from __future__ import annotations

import torch

from bench.kernel_switch import summary, switch, time_passes
from shared.ops.linear import LinearWeight
from shared.ops.quant import int8_per_channel
from tests.helpers.torch_threads import torch_threads


def test_time_passes_runs_both_ways_and_puts_the_switch_back() -> None:
    lin = LinearWeight.quantized(int8_per_channel(torch.randn(96, 64) * 0.05))
    toggle = switch("work_stealing")
    previous = toggle(False)  # not the default: time_passes must restore what it found
    try:
        with torch_threads(2):
            rows = time_passes([lin], [1, 7], toggle, rounds=3)
        assert toggle(True) is False
    finally:
        toggle(previous)
    assert [r["rows"] for r in rows] == [1, 7]
    for r in rows:
        assert len(r["runs"]["off"]) == len(r["runs"]["on"]) == 3
        assert r["off_ms"] > 0 and r["on_ms"] > 0 and r["off_over_on"] > 0
    printed = summary({"bench": "x", "rows": rows, "steps": [], "prefills": []})
    assert printed["bench"] == "x" and all("runs" not in r for r in printed["rows"])
