"""gemma4_unified's images and audio through the router (colocated engine, the official `openai` client on a
real server), as test_router_media.py does for Gemma 4.

A tiny random Gemma4UnifiedForConditionalGeneration over the byte-level test
tokenizer: the router expands each part's placeholders to the unified processor's
counts (one token per 8 px square of the resized image, 40 x 28 px to 80 x 56, one per 640 audio
samples), usage counts them, and the greedy tokens served equal transformers'
`generate` on the same inputs. (Seed 1: seed 0's model answers with the audio
placeholder id, which transformers embeds as the pad token when it comes back as
input and baton's text model as itself; that divergence is Gemma 4's too.)
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from services.router.app import create_app
from services.router.media import RouterMedia
from services.router.settings import RouterSettings
from tests.helpers.gemma4_mm import AUDIO_ID, IMAGE_ID, image_bytes, random_image, random_wave, wav_bytes
from tests.helpers.gemma4_unified_mm import hf_unified_greedy, tiny_unified_loaded, unified_processor
from tests.helpers.models import tiny_engine
from tests.helpers.tokenizers import BYTE_VOCAB, byte_tokenizer
from tests.integration.router.helpers import EngineUnderTest, engine_under_test, serve

MODEL = "tiny-gemma4-unified"


@pytest.fixture(scope="module")
def unified() -> Iterator[tuple[EngineUnderTest, Any, openai.OpenAI]]:
    loaded, hf = tiny_unified_loaded(seed=1, vocab_size=BYTE_VOCAB)
    loaded.tokenizer = byte_tokenizer()
    with engine_under_test(tiny_engine(loaded, max_num_batched_tokens=32)) as under_test:
        app = create_app(RouterSettings(max_model_len=under_test.engine.max_model_len), under_test.spy,
                         loaded.tokenizer, MODEL, media=RouterMedia(loaded.multimodal, unified_processor()))
        with serve(app) as url:
            yield under_test, hf, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, parts: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})


def test_image_chat_matches_transformers(unified) -> None:
    under_test, hf, client = unified
    url = "data:image/png;base64," + base64.b64encode(image_bytes(40, 28, seed=4)).decode()
    r = _chat(client, [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}])
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt.count(IMAGE_ID) == unified_processor().image_tokens(40, 28) == 70  # 40 x 28 doubled: 10 x 7 squares
    assert r.usage.prompt_tokens == len(prompt)
    tokens, _ = hf_unified_greedy(hf, prompt, [random_image(40, 28, seed=4)], [], 6)
    assert r.choices[0].model_extra["token_ids"] == tokens
    under_test.wait_idle()


def test_audio_chat_matches_transformers(unified) -> None:
    under_test, hf, client = unified
    wave = random_wave(0.3, seed=5)
    r = _chat(client, [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(wave)).decode(),
                                                               "format": "wav"}},
                       {"type": "text", "text": "Transcribe."}])
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt.count(AUDIO_ID) == unified_processor().audio_tokens(len(wave)) == 8  # 4800 samples, 640 a token
    tokens, _ = hf_unified_greedy(hf, prompt, [], [wave], 6)
    assert r.choices[0].model_extra["token_ids"] == tokens
    under_test.wait_idle()
