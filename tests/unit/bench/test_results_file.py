"""bench.results_file: the stamped name, the directory, and each JSON layout the benches rely on."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from bench.results_file import write_results

RESULT = {"bench": "demo", "rows": [{"batch": 1, "ms": 2.5}], "nested": {"a": None}}


def test_writes_stamped_name_in_a_created_directory(tmp_path: Path) -> None:
    out_dir = tmp_path / "a" / "b"  # two levels missing: parents are created too
    before = time.strftime("%Y%m%d-%H%M%S")
    path = write_results(dict(RESULT), out_dir, "demo")
    after = time.strftime("%Y%m%d-%H%M%S")
    assert path.parent == out_dir
    match = re.fullmatch(r"demo-(\d{8}-\d{6})\.json", path.name)
    assert match is not None, path.name
    assert before <= match.group(1) <= after  # the stamp is the write's local time
    assert json.loads(path.read_text()) == RESULT


def test_default_layout_is_indent_2_and_indent_1_on_request(tmp_path: Path) -> None:
    path = write_results(dict(RESULT), tmp_path, "two")
    assert path.read_text() == json.dumps(RESULT, indent=2)
    path = write_results(dict(RESULT), tmp_path, "one", indent=1)
    assert path.read_text() == json.dumps(RESULT, indent=1)


def test_indent_none_writes_one_compact_line(tmp_path: Path) -> None:
    path = write_results(dict(RESULT), tmp_path, "sweep", indent=None)
    text = path.read_text()
    assert text == json.dumps(RESULT, separators=(",", ":"))
    assert "\n" not in text and ": " not in text and ", " not in text


def test_record_name_stores_the_file_name_before_writing(tmp_path: Path) -> None:
    result = dict(RESULT)
    path = write_results(result, tmp_path, "named", record_name=True)
    assert result["file"] == path.name  # the caller's dict carries it (README tables cite it)
    assert json.loads(path.read_text())["file"] == path.name
    assert "file" not in json.loads(write_results(dict(RESULT), tmp_path, "unnamed").read_text())


def test_default_hook_serializes_values_json_lacks(tmp_path: Path) -> None:
    path = write_results({"ids": {3}}, tmp_path, "sets", indent=1, default=list)
    assert json.loads(path.read_text()) == {"ids": [3]}
