"""Which prebuilt CPU kernel library `_build()` accepts: only one stamped with these very sources.

That the image's prebuilt library loads with no compiler is tests/deploy/test_image.py's (the image
is built there); here, the stamp check that keeps a stale library from loading over new sources.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from shared.ops import cpu_kernels


def _prebuilt(tmp_path: Path, stamp: dict[str, str]) -> Path:
    (tmp_path / "baton_cpu_kernels.so").write_bytes(b"not a library")
    (tmp_path / "stamp.json").write_text(json.dumps(stamp))
    return tmp_path


def test_the_stamp_names_the_sources_torch_and_machine() -> None:
    stamp = cpu_kernels.sources_stamp()
    assert stamp["torch"] == torch.__version__
    assert len(stamp["sources_sha256"]) == 64 and stamp["machine"]
    assert cpu_kernels.PREBUILT_DIR == Path(cpu_kernels.__file__).parent / "prebuilt"


@pytest.mark.parametrize("field", ["sources_sha256", "torch", "machine"])
def test_a_library_stamped_for_other_sources_is_not_loaded(tmp_path: Path, field: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    stamp = dict(cpu_kernels.sources_stamp(), **{field: "something else"})
    with caplog.at_level(logging.WARNING):
        assert not cpu_kernels._load_prebuilt(_prebuilt(tmp_path, stamp))  # never reaches load_library
    assert "built from other sources" in caplog.text


def test_no_prebuilt_library_means_compiling(tmp_path: Path) -> None:
    assert not cpu_kernels._load_prebuilt(tmp_path)
    (tmp_path / "stamp.json").write_text(json.dumps(cpu_kernels.sources_stamp()))
    assert not cpu_kernels._load_prebuilt(tmp_path)  # a stamp without its library


def test_a_matching_stamp_loads_the_library(tmp_path: Path) -> None:
    """A garbage file with the right stamp goes to torch.ops.load_library, which refuses it loudly."""
    with pytest.raises(OSError):
        cpu_kernels._load_prebuilt(_prebuilt(tmp_path, cpu_kernels.sources_stamp()))
