"""`baton up --model <dir>` on a tiny multimodal Gemma 4 checkpoint (every text feature on), through the
official `openai` client: disaggregated equals colocated equals transformers, and the chat template is
Gemma 4's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.helpers.gemma4 import hf_from_checkpoint, hf_greedy, tiny_gemma4_checkpoint
from tests.helpers.stack import BatonStack, disagg_and_colocated

pytestmark = pytest.mark.slow

NUM_TOKENS = 12
ARGS = ("--max-model-len", "512", "--kv-cache-bytes", str(16 << 20))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4") / "tiny")


@pytest.fixture(scope="module")
def stacks(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BatonStack]]:
    with disagg_and_colocated(tmp_path_factory, "--model", str(checkpoint), *ARGS) as started:
        yield started


def complete(stack: BatonStack, model: str, prompt: list[int]) -> str:
    c = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    out = c.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                               extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == NUM_TOKENS
    return out.choices[0].text


def test_disaggregated_equals_colocated_and_transformers(checkpoint: Path, stacks: dict[str, BatonStack]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    hf = hf_from_checkpoint(checkpoint)
    for prompt in ([2, 17, 300, 4000], list(range(5000, 5037))):  # the second: four sliding windows long
        texts = {mode: complete(stack, str(checkpoint), prompt) for mode, stack in stacks.items()}
        assert texts["disagg"] == texts["colocated"]
        assert texts["disagg"] == tokenizer.decode(hf_greedy(hf, prompt, NUM_TOKENS), skip_special_tokens=True)


def test_chat_uses_the_gemma4_template(checkpoint: Path, stacks: dict[str, BatonStack]) -> None:
    c = openai.OpenAI(base_url=stacks["disagg"].base_url, api_key="unused", max_retries=0, timeout=120)
    out = c.chat.completions.create(model=str(checkpoint), messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=4, temperature=0)
    # the stand-in tokenizer spells "<bos><|turn>user\nHi<turn|>\n<|turn>model\n" in ordinary pieces
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    expected = tokenizer("<bos><|turn>user\nHi<turn|>\n<|turn>model\n", add_special_tokens=False).input_ids
    assert out.usage.prompt_tokens == len(expected)
