"""Tiny multimodal Gemma 4 models (vision and audio towers) and media to feed them, for fidelity tests.

The text part is one of tests/helpers/gemma4.py's variants with the 256-token
vocabulary; the placeholder and delimiter ids are `SMALL_VOCAB_TOKEN_IDS`.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from shared.models.gemma4.tiny import (
    SMALL_VOCAB_TOKEN_IDS,
    multimodal_model_config,
    randomize,
)
from tests.helpers.gemma4 import tiny_gemma4_config

IMAGE_ID = SMALL_VOCAB_TOKEN_IDS["image_token_id"]
AUDIO_ID = SMALL_VOCAB_TOKEN_IDS["audio_token_id"]
VIDEO_ID = SMALL_VOCAB_TOKEN_IDS["video_token_id"]
BOI, EOI = SMALL_VOCAB_TOKEN_IDS["boi_token_id"], SMALL_VOCAB_TOKEN_IDS["eoi_token_id"]
BOA, EOA = SMALL_VOCAB_TOKEN_IDS["boa_token_id"], SMALL_VOCAB_TOKEN_IDS["eoa_token_index"]


def tiny_mm_config(variant: str = "all", bidirectional: bool = True, **overrides: Any) -> Any:
    text = tiny_gemma4_config(variant, **overrides)
    if bidirectional:
        text.use_bidirectional_attention = "vision"
    return multimodal_model_config(text, vision=True, audio=True, token_ids=SMALL_VOCAB_TOKEN_IDS)


def tiny_mm_hf(variant: str = "all", bidirectional: bool = True, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers Gemma4ForConditionalGeneration with both towers."""
    from transformers import Gemma4ForConditionalGeneration

    return randomize(Gemma4ForConditionalGeneration(tiny_mm_config(variant, bidirectional, **overrides)).eval(), seed)


def media_processor() -> Any:
    """The tiny towers' processor (what `baton make-tiny gemma4 --vision --audio` writes)."""
    from shared.models.gemma4.tiny import tiny_processor_config
    from shared.multimodal.processor import Gemma4MediaProcessor

    return Gemma4MediaProcessor(tiny_processor_config())


def random_image(width: int, height: int, seed: int = 0) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    random_image(width, height, seed).save(buf, format=fmt)
    return buf.getvalue()


def random_wave(seconds: float, seed: int = 0, rate: int = 16_000) -> np.ndarray:
    """A chirp plus noise: something with structure for the mel frames."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * (200 + 900 * t) * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def wav_bytes(wave: np.ndarray, rate: int = 16_000, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def video_bytes(num_frames: int, width: int, height: int, fps: int = 4, seed: int = 0,
                container: str = "mp4", codec: str = "mpeg4") -> bytes:
    """A short video (PyAV/FFmpeg) of moving random blocks: frames that differ, compressed as any upload is."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 2, width // 8 + 2, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            blocks = np.roll(base, i, axis=1).repeat(8, axis=0).repeat(8, axis=1)[:height, :width]
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(blocks), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def hf_video_inputs(frames: list[Any]) -> dict[str, torch.Tensor]:
    """transformers' video inputs (Gemma4VideoProcessor's layout: each frame's patches padded to the budget,
    padding positions -1) for processed frames ([h, w, 3] uint8, as video.py leaves them)."""
    proc = media_processor()
    cut = [proc.video_frame(f) for f in frames]
    rules = proc.video_rules
    width = rules.max_soft_tokens * rules.pooling_kernel_size**2
    pixels = torch.zeros(len(cut), width, cut[0].patches.shape[1])
    positions = torch.full((len(cut), width, 2), -1, dtype=torch.long)
    for i, c in enumerate(cut):
        pixels[i, : c.patches.shape[0]] = c.patches
        positions[i, : c.positions.shape[0]] = c.positions
    return {"pixel_values_videos": pixels, "video_position_ids": positions,
            "num_frames_per_video": torch.tensor([len(cut)])}


def text_weights(hf: Any) -> dict[str, torch.Tensor]:
    """The text model's tensors of a ForConditionalGeneration, under the *ForCausalLM names baton reads."""
    prefix = "model.language_model."
    return {("model." + k[len(prefix):]) if k.startswith(prefix) else k: v for k, v in hf.state_dict().items()}


def mm_token_type_ids(ids: list[int], image_id: int = IMAGE_ID, audio_id: int = AUDIO_ID,
                      video_id: int = VIDEO_ID) -> torch.Tensor:
    """[1, n]: 1 at image tokens, 2 at video tokens, 3 at audio tokens, as Gemma4Processor marks them."""
    return torch.tensor([[1 if t == image_id else 2 if t == video_id else 3 if t == audio_id else 0 for t in ids]])


def tiny_mm_loaded(variant: str = "all", bidirectional: bool = True, seed: int = 0,
                   **overrides: Any) -> tuple[Any, Any]:
    """(baton's LoadedModel with its media encoder, transformers' model) on the same random weights."""
    from pathlib import Path

    from shared.engine.engine import pick_attention
    from shared.models.families import build_model, spec_from_config
    from shared.models.gemma4.multimodal import Gemma4Encoders, multimodal_config
    from shared.models.loader import LoadedModel
    from shared.multimodal.encoder import MediaEncoder

    hf = tiny_mm_hf(variant, bidirectional, seed, **overrides)
    spec = spec_from_config(hf.config.text_config)
    model = build_model(spec, text_weights(hf), pick_attention("auto", "cpu"))
    encoder = MediaEncoder(media_processor(), Gemma4Encoders(hf.config, hf.state_dict()))
    loaded = LoadedModel(name="tiny-gemma4-mm", hf_dir=Path("/nonexistent"), hf_config=hf.config.text_config,
                         spec=spec, model=model, tokenizer=None, eos_token_ids=frozenset({1}),
                         media_encoder=encoder, multimodal=multimodal_config(hf.config))
    return loaded, hf


def mm_prompt(text_before: list[int], media: list[tuple[str, bytes, int]], text_after: list[int],
              audio_format: str = "wav") -> tuple[list[int], list[Any]]:
    """A prompt with each (kind, data, num soft tokens) as its delimited placeholder run, and its MediaItems."""
    from shared.multimodal.items import MediaItem
    from shared.multimodal.media import content_hash

    ids, items = list(text_before), []
    for kind, data, n in media:
        begin, token, end = (BOI, IMAGE_ID, EOI) if kind == "image" else (BOA, AUDIO_ID, EOA)
        ids.append(begin)
        items.append(MediaItem(kind, len(ids), n, content_hash(data), data, audio_format if kind == "audio" else ""))
        ids += [token] * n + [end]
    return ids + list(text_after), items


def hf_mm_greedy(hf: Any, ids: list[int], images: list[Any], waves: list[Any], num_tokens: int,
                 video_frames: list[Any] | None = None) -> list[int]:
    """transformers' greedy continuation of a prompt with these PIL images, 16 kHz waves and one video's
    processed frames."""
    return hf_mm_greedy_logprobs(hf, ids, images, waves, num_tokens, video_frames)[0]


def hf_mm_greedy_logprobs(hf: Any, ids: list[int], images: list[Any], waves: list[Any], num_tokens: int,
                          video_frames: list[Any] | None = None) -> tuple[list[int], list[float]]:
    """`hf_mm_greedy`'s tokens and the log-probability of each."""
    proc = media_processor()
    kwargs: dict[str, Any] = {"mm_token_type_ids": mm_token_type_ids(ids, hf.config.image_token_id,
                                                                      hf.config.audio_token_id,
                                                                      hf.config.video_token_id)}
    if video_frames:
        kwargs |= hf_video_inputs(video_frames)
    if images:
        pix = proc.images(images=images, return_tensors="pt")
        kwargs |= dict(pixel_values=pix["pixel_values"], image_position_ids=pix["image_position_ids"])
    if waves:
        feats = proc.audio_features(waves, return_tensors="pt")
        kwargs |= dict(input_features=feats["input_features"], input_features_mask=feats["input_features_mask"])
    out = hf.generate(torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                      output_hidden_states=True, return_dict_in_generate=True, output_logits=True, **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def whole_mm_prompt(num_image: int, num_audio: int) -> list[int]:
    """Text, an image's and a clip's placeholder runs (either may be 0 long), text: the model-level tests' prompt."""
    ids = [2, 17, 99, 5]
    if num_image:
        ids += [BOI] + [IMAGE_ID] * num_image + [EOI] + [44, 45]
    if num_audio:
        ids += [BOA] + [AUDIO_ID] * num_audio + [EOA]
    return ids + [61, 7, 33]


def whole_prompt_logits(model: Any, ids: list[int], soft: torch.Tensor, image_mask: str) -> torch.Tensor:
    """One forward over the whole prompt on a fresh paged cache, soft tokens at the placeholder rows.
    `image_mask`: how the image's tokens see each other: "causal" (not both ways), "sliding" (both ways on
    sliding layers within the window: Gemma 4) or "every_layer" (on every layer: gemma4_unified)."""
    from shared.kv.layout import KVLayout
    from shared.ops.attention import AttentionMetadata

    assert image_mask in ("causal", "sliding", "every_layer"), image_mask
    n, bs = len(ids), 4
    blocks = -(-n // bs)
    layout = KVLayout.of(model.spec.kv_layers, blocks + 2, bs, model.dtype)
    kv = layout.model_cache(layout.allocate(model.device))
    pos = torch.arange(n)
    table = torch.randperm(blocks + 2)[:blocks]
    rows = torch.tensor([i for i, t in enumerate(ids) if t in (IMAGE_ID, AUDIO_ID)])
    image = [i for i, t in enumerate(ids) if t == IMAGE_ID]
    meta = AttentionMetadata(table[pos // bs] * bs + pos % bs, torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), table[None].int(), [n], [n])
    if image_mask != "causal" and image:
        meta.bidirectional_spans = {0: [(image[0], image[-1] + 1)]}
        meta.bidirectional_every_layer = image_mask == "every_layer"
    hidden = model.forward(torch.tensor(ids), pos, kv, meta, soft_tokens=(rows, soft))
    return model.compute_logits(hidden)
