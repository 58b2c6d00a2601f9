"""Images, audio and video through `baton up` on a tiny Gemma 4 checkpoint with both towers, through the official
`openai` client: the disaggregated stack (an encoder instance encodes, its outputs and the KV go through
kv_transfer, decode generates) answers exactly as the colocated one, the media are counted in usage, and a bad image is a 400 that leaves
every engine's blocks and kv_transfer's leases at their totals. (Fidelity against transformers on the same
inputs is the engine's and the router's integration tests' job; this is the served path as users run it.)"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers.gemma4 import tiny_gemma4_checkpoint
from tests.helpers.gemma4_mm import image_bytes, media_processor, random_wave, video_bytes, wav_bytes
from tests.helpers.stack import BatonStack, disagg_and_colocated, wait_idle

pytestmark = pytest.mark.slow

NUM_TOKENS = 10
ARGS = ("--max-model-len", "512", "--kv-cache-bytes", str(16 << 20))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4-media") / "tiny", vision=True, audio=True)


@pytest.fixture(scope="module")
def stacks(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BatonStack]]:
    with disagg_and_colocated(tmp_path_factory, "--model", str(checkpoint), *ARGS,
                              disagg_args=("--encoder", "1")) as started:
        yield started


def image_part(seed: int) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image_bytes(40, 28, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def audio_part(seed: int) -> dict[str, Any]:
    data = base64.b64encode(wav_bytes(random_wave(0.5, seed=seed))).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def video_part(seed: int) -> dict[str, Any]:
    url = "data:video/mp4;base64," + base64.b64encode(video_bytes(3, 40, 28, fps=2, seed=seed)).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def chat(stack: BatonStack, model: str, parts: list[dict[str, Any]]) -> Any:
    c = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    content = [{"type": "text", "text": "Describe:"}, *parts]
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                     max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})


def test_image_and_audio_disaggregated_equal_colocated(checkpoint: Path, stacks: dict[str, BatonStack]) -> None:
    processor = media_processor()
    text_only = chat(stacks["colocated"], str(checkpoint), []).usage.prompt_tokens
    for parts, media_tokens in (
        ([image_part(1)], processor.image_tokens(40, 28)),
        ([audio_part(2)], processor.audio_tokens(8000)),
        ([image_part(3), audio_part(4)], processor.image_tokens(40, 28) + processor.audio_tokens(8000)),
        ([video_part(6)], 3 * processor.image_tokens(40, 28)),  # three frames, each as an image of its size
    ):
        out = {mode: chat(stack, str(checkpoint), parts) for mode, stack in stacks.items()}
        assert out["disagg"].choices[0].message.content == out["colocated"].choices[0].message.content
        for o in out.values():
            assert o.usage.completion_tokens == NUM_TOKENS
            # each item: its soft tokens plus begin/end markers (and the template's spacing) beyond the text
            assert o.usage.prompt_tokens >= text_only + media_tokens
        assert out["disagg"].usage.prompt_tokens == out["colocated"].usage.prompt_tokens
    # the seven items (four, and the video's three frames) went through the encoder, and the prefill found each
    # output in kv_transfer
    assert stacks["disagg"].metric("encoder-0", "baton_encoder_items_total") == 7
    assert stacks["disagg"].metric("kv_transfer", "baton_encoder_cache_lookups_total", 'result="hit"') >= 7
    for stack in stacks.values():
        wait_idle(stack)


def test_bad_image_is_a_400_and_leaks_nothing(checkpoint: Path, stacks: dict[str, BatonStack]) -> None:
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}}
    for stack in stacks.values():
        with pytest.raises(openai.BadRequestError) as err:
            chat(stack, str(checkpoint), [image_part(5), broken])
        assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        wait_idle(stack)
        assert chat(stack, str(checkpoint), [image_part(5)]).usage.completion_tokens == NUM_TOKENS
