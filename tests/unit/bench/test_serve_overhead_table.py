"""bench/serve_overhead.py's README table: the latest run of each precision and stream interval."""

from __future__ import annotations

import json
from pathlib import Path

from bench.serve_overhead import readme_table


def _run(path: Path, precision: str, tok_s: float, interval: int | None, isa: str | None = None) -> None:
    point = {"output_tok_s": tok_s, "p50_ttft_ms": 50.0, "p50_tpot_ms": 5.0}
    row = {"engine": {**point, "output_tok_s": 200.0}, "served": point, "served_over_engine": tok_s / 200.0,
           "cpu_ms_per_token": {"router": 0.1, "client": 0.05}}
    machine = {"commit": "abc", "cpu_model": "AMD EPYC"} | ({"isa": isa} if isa is not None else {})
    run = {"precision": precision, "quick": False, "file": path.name, "machine": machine,
           "stacks": {"colocated": {"rounds": [row], "served_over_engine": tok_s / 200.0}}}
    if interval is not None:  # runs before the stream interval existed have no such key
        run["stream_interval"] = interval
    path.write_text(json.dumps(run))


def test_each_stream_interval_keeps_its_own_latest_row(tmp_path: Path) -> None:
    _run(tmp_path / "serve_overhead-20261129-100000.json", "int8", 150.0, None)
    _run(tmp_path / "serve_overhead-20261129-110000.json", "int8", 160.0, 1)
    _run(tmp_path / "serve_overhead-20261129-120000.json", "int8", 190.0, 8, isa="avx2")
    rows = [line for line in readme_table(tmp_path).splitlines() if line.startswith("| int8")]
    assert len(rows) == 2
    assert "110000" in rows[0] and "**0.80**" in rows[0] and "| AMD EPYC |" in rows[0]
    assert rows[1].startswith("| int8, stream interval 8 |") and "**0.95**" in rows[1]
    assert "| AMD EPYC (avx2) |" in rows[1]  # the kernels' level, where the run recorded it
