"""Local HF checkpoints as a user points baton at them: `baton make-tiny gemma4`, then serve it; checkpoints
that cannot be served fail at load, naming the architecture or the tensor, before anything starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers.gemma4 import hf_from_checkpoint, hf_greedy

pytestmark = pytest.mark.slow


def baton(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shared.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma4ForCausalLM with the MoE block, from the CLI."""
    out = tmp_path_factory.mktemp("make-tiny") / "moe"
    proc = baton("make-tiny", "gemma4", "--moe", "--layers", "4", "--out", str(out), "--max-shard-size", "20MB")
    assert proc.returncode == 0, proc.stderr
    return out


def test_make_tiny_writes_a_sharded_checkpoint_baton_serves_as_transformers_does(causal_lm: Path) -> None:
    index = json.loads((causal_lm / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((causal_lm / "config.json").read_text())["architectures"] == ["Gemma4ForCausalLM"]
    assert (causal_lm / "chat_template.jinja").read_text().count("<|turn>") >= 3
    proc = baton("generate", "--model", str(causal_lm), "--prompt", "The tiny model says", "--max-tokens", "10",
                 "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(causal_lm)("The tiny model says").input_ids
    assert out["token_ids"] == hf_greedy(hf_from_checkpoint(causal_lm), prompt, 10)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensor(checkpoint: Path, name: str, replacement: object) -> None:
    """Drop tensor `name` from its shard (replacement None) or replace it, keeping the index true."""
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = checkpoint / index["weight_map"][name]
    tensors = load_file(shard)
    if replacement is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = replacement
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("command", ["generate", "up"])
def test_a_checkpoint_missing_a_tensor_fails_naming_it(causal_lm: Path, tmp_path: Path, command: str) -> None:
    bad = _copy(causal_lm, tmp_path / "missing")
    _edit_tensor(bad, "model.layers.1.self_attn.k_proj.weight", None)
    args = ["--prompt", "hi"] if command == "generate" else ["--state-dir", str(tmp_path / "state")]
    proc = baton(command, "--model", str(bad), *args, timeout_s=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "checkpoint lacks tensor 'model.layers.1.self_attn.k_proj.weight'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state" / "stack.json").exists()  # `up` started no service


def test_a_misshapen_tensor_fails_naming_it(causal_lm: Path, tmp_path: Path) -> None:
    import torch

    bad = _copy(causal_lm, tmp_path / "misshapen")
    _edit_tensor(bad, "model.layers.2.experts.down_proj", torch.zeros(8, 64, 31))
    proc = baton("generate", "--model", str(bad), "--prompt", "hi")
    assert proc.returncode == 2
    assert "checkpoint tensor 'model.layers.2.experts.down_proj' has shape (8, 64, 31)" in proc.stderr


def test_an_unsupported_architecture_is_named(causal_lm: Path, tmp_path: Path) -> None:
    bad = _copy(causal_lm, tmp_path / "mistral")
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    proc = baton("generate", "--model", str(bad), "--prompt", "hi")
    assert proc.returncode == 2
    assert "architecture MistralForCausalLM is not supported" in proc.stderr


def test_make_tiny_unified_writes_the_embedders_baton_reads(tmp_path: Path) -> None:
    """`--unified --vision --audio`: the 12B layout with its encoder-free embedders, under the names transformers
    saves (the engine's fidelity test serves one: tests/integration/engine/test_gemma4_unified_engine.py); a
    checkpoint without one of them fails at load, naming it."""
    from shared.multimodal.loading import read_multimodal
    from shared.multimodal.unified_processor import Gemma4UnifiedMediaProcessor

    out = tmp_path / "unified"
    proc = baton("make-tiny", "gemma4", "--unified", "--vision", "--audio", "--layers", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma4UnifiedForConditionalGeneration"]
    found = read_multimodal(out, "Gemma4UnifiedForConditionalGeneration")
    assert found is not None and isinstance(found[1], Gemma4UnifiedMediaProcessor)
    assert found[0].has_vision and found[0].has_audio and found[0].bidirectional_every_layer
    _edit_tensor(out, "model.vision_embedder.patch_dense.weight", None)
    proc = baton("generate", "--model", str(out), "--prompt", "hi")
    assert proc.returncode == 2
    assert "checkpoint lacks tensor 'model.vision_embedder.patch_dense.weight'" in proc.stderr
