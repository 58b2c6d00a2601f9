"""bench/kernel_tuning.py: the second library's sources (every op under another namespace, the layer loop's
class renamed) and the paired figures; the build and the timed run are the bench's own."""

from __future__ import annotations

import re
from pathlib import Path

from bench.kernel_tuning import ALT_CLASS, ALT_NAMESPACE, alt_sources, alternate, ratio_row
from shared.ops.cpu_kernels import HEADERS, SOURCES


def test_every_source_registers_its_ops_under_the_other_namespace(tmp_path: Path) -> None:
    sources = alt_sources(tmp_path)
    assert [Path(s).name for s in sources] == [p.name for p in SOURCES]
    for source in sources:
        text = Path(source).read_text()
        assert not re.search(r"TORCH_LIBRARY\w*\(baton_cpu,", text), source
        assert f"({ALT_NAMESPACE}," in text, source
    layers = (tmp_path / "csrc" / "decoder_layers_cpu.cpp").read_text()
    assert f'"{ALT_CLASS}"' in layers and not re.search(r"\bDecoderLayers\b", layers)
    # staged again, an unchanged copy is left as it was (its new mtime would rebuild the whole library)
    before = {s: Path(s).stat().st_mtime_ns for s in sources}
    assert alt_sources(tmp_path) == sources
    assert {s: Path(s).stat().st_mtime_ns for s in sources} == before
    # the headers come along unchanged
    for header in HEADERS:
        assert (tmp_path / "csrc" / header.name).read_text() == header.read_text()


def test_alternate_times_each_in_turn_and_drops_the_warm_up_round() -> None:
    calls: list[str] = []
    times = alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, reps=2)
    assert [len(v) for v in times.values()] == [3, 3]
    # per round: the first call settles, then `reps` timed; every other round the order flips
    assert calls == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3 + ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3


def test_ratio_row_is_the_median_of_paired_rounds() -> None:
    row = ratio_row("batch", 1, [0.010, 0.010, 0.020], [0.011, 0.012, 0.020])
    assert row["batch"] == 1 and row["repo_ms"] == 10.0 and row["other_ms"] == 12.0
    assert row["other_over_repo"] == 1.1  # of 1.1, 1.2 and 1.0
    assert row["runs"]["other"] == [11.0, 12.0, 20.0]
