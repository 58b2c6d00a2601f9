"""`baton generate` as a user runs it: a real process, the packaged model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shared.engine.request import SamplingParams
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged_engine

pytestmark = pytest.mark.slow


def baton(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shared.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_json_equals_engine_greedy() -> None:
    proc = baton("generate", "--model", "smollm2-135m", "--chat", "--prompt", "What is the capital of France?",
                 "--max-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == {"token_ids", "text", "finish_reason"}
    engine = packaged_engine("smollm2-135m")
    prompt = encode_prompt(engine.loaded.tokenizer, "What is the capital of France?", chat=True)
    expected = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out["token_ids"] == expected.token_ids
    assert out["finish_reason"] == expected.finish_reason
    assert "Paris" in out["text"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no-such-model", "--prompt", "hi"], "unknown model"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (["--prompt", "hi " * 300, "--max-model-len", "128"], "context"),
        (["--model", "gemma3-270m", "--prompt", "hi", "--chat"], "no chat template"),
    ],
)
def test_bad_input_exits_nonzero_without_traceback(args: list[str], message: str) -> None:
    proc = baton("generate", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
