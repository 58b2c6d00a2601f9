"""Images, audio and video through the router (colocated engine, the official `openai` client on a real server).

A tiny random multimodal Gemma 4 over the byte-level test tokenizer: the prompt
the router builds (placeholders expanded to Gemma4Processor's soft-token counts,
counted in usage) and the greedy tokens served equal transformers' `generate` on
the same inputs; `image_url` as a data URL and from an allowed http URL,
`input_audio` wav and mp3, `video_url` (its frames sampled and stamped as
Gemma4Processor writes them), the Responses API's `input_image`. Bad media gets a
400 with OpenAI's error body and leaves no request or KV block behind.
"""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from services.router.app import create_app
from services.router.media import RouterMedia
from services.router.settings import RouterSettings
from shared.multimodal.media import MediaLimits
from shared.multimodal.video import decode_video, timestamp
from tests.helpers.gemma4_mm import (
    AUDIO_ID,
    BOI,
    EOI,
    IMAGE_ID,
    VIDEO_ID,
    hf_mm_greedy,
    hf_mm_greedy_logprobs,
    image_bytes,
    media_processor,
    random_image,
    random_wave,
    tiny_mm_loaded,
    video_bytes,
    wav_bytes,
)
from tests.helpers.models import tiny_engine
from tests.helpers.tokenizers import BYTE_VOCAB, byte_tokenizer
from tests.integration.router.helpers import EngineUnderTest, engine_under_test, serve

MODEL = "tiny-gemma4-mm"
LIMITS = MediaLimits(max_image_bytes=60_000, max_items=2, max_video_bytes=5_000, max_video_seconds=5.0)


@pytest.fixture(scope="module")
def mm() -> Iterator[tuple[EngineUnderTest, Any]]:
    loaded, hf = tiny_mm_loaded("all", vocab_size=BYTE_VOCAB, vocab_size_per_layer_input=BYTE_VOCAB)
    loaded.tokenizer = byte_tokenizer()
    with engine_under_test(tiny_engine(loaded, max_num_batched_tokens=32)) as under_test:
        yield under_test, hf


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A local http server with one PNG at /cat.png."""
    body = image_bytes(40, 28, seed=3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


@pytest.fixture(scope="module")
def client(mm: tuple[EngineUnderTest, Any]) -> Iterator[openai.OpenAI]:
    under_test, _ = mm
    loaded = under_test.engine.loaded
    media = RouterMedia(loaded.multimodal, media_processor(), LIMITS, url_allowlist=("127.0.0.1",))
    app = create_app(RouterSettings(max_model_len=under_test.engine.max_model_len), under_test.spy,
                     loaded.tokenizer, MODEL, media=media)
    with serve(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _chat(client: openai.OpenAI, parts: list[dict[str, Any]], max_tokens: int = 6) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})


def test_image_chat_matches_transformers(mm, client) -> None:
    under_test, hf = mm
    r = _chat(client, [{"type": "text", "text": "What is this?"},
                       {"type": "image_url", "image_url": {"url": data_url(image_bytes(40, 28, seed=3))}}])
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt.count(IMAGE_ID) == media_processor().image_tokens(40, 28)
    assert r.usage.prompt_tokens == len(prompt)  # the image's soft tokens count
    assert r.choices[0].model_extra["token_ids"] == hf_mm_greedy(hf, prompt, [random_image(40, 28, seed=3)], [], 6)
    under_test.wait_idle()


def test_tokenize_counts_the_image_tokens(mm, client) -> None:
    parts = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": data_url(image_bytes(40, 28, seed=3))}}]
    chat = _chat(client, parts, max_tokens=1)
    r = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == chat.model_extra["prompt_token_ids"]
    mm[0].wait_idle()


def test_image_from_an_allowed_url_equals_the_data_url(mm, client, image_server) -> None:
    under_test, _ = mm
    text = {"type": "text", "text": "What is this?"}
    by_url = _chat(client, [text, {"type": "image_url", "image_url": {"url": f"{image_server}/cat.png"}}])
    by_data = _chat(client, [text, {"type": "image_url", "image_url": {"url": data_url(image_bytes(40, 28, seed=3))}}])
    assert by_url.choices[0].model_extra["token_ids"] == by_data.choices[0].model_extra["token_ids"]
    under_test.wait_idle()


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_audio_chat_matches_transformers(mm, client, fmt: str) -> None:
    import soundfile

    under_test, hf = mm
    wave = random_wave(0.6, seed=5)
    data = wav_bytes(wave) if fmt == "wav" else wav_bytes(wave, fmt="MP3", subtype="MPEG_LAYER_III")
    r = _chat(client, [{"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(),
                                                               "format": fmt}},
                       {"type": "text", "text": "Transcribe."}])
    prompt = r.model_extra["prompt_token_ids"]
    import io

    decoded, _ = soundfile.read(io.BytesIO(data), dtype="float32")  # what the server hears (mp3 is lossy)
    assert prompt.count(AUDIO_ID) == media_processor().audio_tokens(len(decoded))
    assert r.choices[0].model_extra["token_ids"] == hf_mm_greedy(hf, prompt, [], [decoded], 6)
    under_test.wait_idle()


def test_video_chat_matches_transformers(mm, client) -> None:
    """Five frames of a video: each "MM:SS <boi><video>*n<eoi>", joined by spaces, in the prompt; the tokens
    served are transformers' on those frames (mm_token_type_ids 2: each frame's tokens see each other)."""
    under_test, hf = mm
    data = video_bytes(5, 40, 28, fps=2, seed=4)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What happens?"},
            {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}]}],
        max_tokens=6, temperature=0, logprobs=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt = r.model_extra["prompt_token_ids"]
    video = decode_video(data, media_processor().video_rules, LIMITS, "messages")
    assert len(video.frames) == 5 and prompt.count(VIDEO_ID) == 5 * video.tokens_per_frame
    assert r.usage.prompt_tokens == len(prompt)
    starts = [i for i, t in enumerate(prompt) if t == BOI]
    ends = [i for i, t in enumerate(prompt) if t == EOI]
    tokenizer = under_test.engine.loaded.tokenizer
    assert tokenizer.decode(prompt[: starts[0]]).endswith(f"What happens?\n{timestamp(video.seconds[0])} ")
    for f in range(1, 5):
        assert tokenizer.decode(prompt[ends[f - 1] + 1: starts[f]]) == f" {timestamp(video.seconds[f])} "
    tokens, logprobs = hf_mm_greedy_logprobs(hf, prompt, [], [], 6, video.frames)
    assert r.choices[0].model_extra["token_ids"] == tokens
    served = [t.logprob for t in r.choices[0].logprobs.content]
    assert served == pytest.approx(logprobs, abs=2e-3)  # also what a frame's tokens see of each other
    under_test.wait_idle()


def test_responses_input_image_equals_chat(mm, client) -> None:
    under_test, _ = mm
    url = data_url(image_bytes(30, 30, seed=8))
    chat = _chat(client, [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": url}}])
    resp = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe"}, {"type": "input_image", "image_url": url}]}],
        max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    under_test.wait_idle()


def _tiff() -> bytes:
    import io

    buf = io.BytesIO()
    random_image(8, 8).save(buf, format="TIFF")
    return buf.getvalue()


BAD: dict[str, tuple[list[dict[str, Any]], str]] = {
    "undecodable image": ([{"type": "image_url", "image_url": {"url": data_url(b"\x89PNG not really")}}],
                          "could not be decoded"),
    "unsupported image format": ([{"type": "image_url", "image_url": {"url": data_url(_tiff(), "image/tiff")}}],
                                 "format TIFF is not supported"),
    "unsupported audio format": ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "flac"}}],
                                 "audio format 'flac' is not supported"),
    "undecodable audio": ([{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(b"RIFF....WAVEjunk").decode(), "format": "wav"}}], "could not be decoded"),
    "audio part without its object": ([{"type": "input_audio", "input_audio": "AAAA"}], "needs"),
    "not base64": ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "not valid base64"),
    "too many images": ([{"type": "image_url", "image_url": {"url": data_url(image_bytes(8, 8, seed=i))}}
                         for i in range(3)], "too many images"),
    "image past the size limit": ([{"type": "image_url", "image_url": {"url": data_url(image_bytes(400, 400))}}],
                                  "over the limit"),
    "url not allowed": ([{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}],
                        "not allowed"),
    "undecodable video": ([{"type": "video_url", "video_url": {"url": data_url(b"no video" * 50, "video/mp4")}}],
                          "video could not be decoded"),
    "video past the size limit": ([{"type": "video_url", "video_url": {
        "url": data_url(video_bytes(8, 160, 120, seed=1), "video/mp4")}}], "video of"),
    "video too long": ([{"type": "video_url", "video_url": {"url": data_url(video_bytes(12, 16, 16, fps=2),
                                                                            "video/mp4")}}], "6.0 s is over"),
    "video url not allowed": ([{"type": "video_url", "video_url": {"url": "http://example.com/cat.mp4"}}],
                              "video URL host 'example.com' is not allowed"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_media_is_a_400(mm, client, case: str) -> None:
    under_test, _ = mm
    parts, message = BAD[case]
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, [{"type": "text", "text": "hi"}, *parts])
    assert err.value.status_code == 400 and message in err.value.message
    assert err.value.body["type"] == "invalid_request_error"
    under_test.wait_idle()
    assert not under_test.engine.has_unfinished()


def test_media_to_a_text_only_model_is_a_400(mm) -> None:
    under_test, _ = mm
    app = create_app(RouterSettings(max_model_len=512), under_test.spy, under_test.engine.loaded.tokenizer, MODEL)
    with serve(app) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image_bytes(8, 8))}}]}]})
    assert r.status_code == 400 and "reads text only" in r.json()["error"]["message"]
