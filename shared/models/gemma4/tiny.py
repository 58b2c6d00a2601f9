"""Tiny random Gemma 4 checkpoints, written the way published ones come (`baton make-tiny gemma4`).

No Gemma 4 weights can be downloaded here, so tests, benchmarks and users stand
the whole stack up on these: transformers' own Gemma 4 code builds the model
from a small config with every feature asked for, the weights are drawn wide
(so greedy decoding has clear winners) and `save_pretrained` writes sharded
safetensors with their index. `multimodal` saves a Gemma4ForConditionalGeneration
(text config nested, text weights under `model.language_model.`), as the published
checkpoints are; `vision` and `audio` add tiny towers (vision.py, audio.py) with
their embedders and a `processor_config.json` (image processor and audio feature
extractor settings, as Gemma4Processor saves them) sized for the tiny towers.
`unified` builds the 12B model's layout instead (`gemma4_unified`, tiny_unified.py):
its decoder without PLE or MoE and, with `vision` / `audio`, its encoder-free embedders.

The tokenizer is a stand-in: the packaged Gemma 3 tokenizer (the same 262,144
token vocabulary, but without Gemma 4's control tokens such as `<|turn>`, which
it splits into ordinary pieces). The chat template is Gemma 4's
(`chat_template.jinja` next to this file).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.errors import ConfigError
from shared.models.gemma4.tiny_unified import (
    unified_model_config,
    unified_processor_config,
    unified_text_config,
)

logger = logging.getLogger(__name__)

CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
GEMMA_VOCAB = 262_144  # Gemma 3's and Gemma 4's vocabulary
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TinyGemma4:
    """What `baton make-tiny gemma4` builds; every Gemma4TextConfig branch is a field."""

    num_layers: int = 6  # alternating sliding / full, the last full
    hidden_size: int = 64
    moe: bool = False  # enable_moe_block: 8 experts, top 2
    k_eq_v: bool = False  # attention_k_eq_v on full layers (one KV head there)
    kv_shared_layers: int = 0  # num_kv_shared_layers
    ple_size: int = 0  # hidden_size_per_layer_input (0 = no per-layer embeddings)
    double_wide_mlp: bool = False  # use_double_wide_mlp (KV-shared layers' MLP twice as wide)
    sliding_window: int = 32
    vocab_size: int = GEMMA_VOCAB
    multimodal: bool = False  # save as Gemma4ForConditionalGeneration
    vision: bool = False  # with a vision tower (implies multimodal)
    audio: bool = False  # with an audio tower (implies multimodal)
    bidirectional_vision: bool = False  # use_bidirectional_attention="vision" (always so with `unified`)
    unified: bool = False  # gemma4_unified: the 12B model's decoder and encoder-free media embedders
    seed: int = 0


# the tiny towers' image processor: 4 px patches pooled 2 x 2, at most 70 soft tokens (the smallest budget
# transformers' Gemma4ImageProcessor accepts), so an image of up to 280 patches
TINY_IMAGE_PROCESSOR: dict[str, Any] = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
# its video processor: Gemma4VideoProcessor's settings (transformers' class cannot be built without torchvision,
# so they are written out), the same patches, 70 soft tokens a frame, at most 32 frames
TINY_VIDEO_PROCESSOR: dict[str, Any] = dict(
    TINY_IMAGE_PROCESSOR, video_processor_type="Gemma4VideoProcessor", num_frames=32, do_sample_frames=True,
    do_resize=True, resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
    image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0], do_convert_rgb=True, return_metadata=True)
# placeholder and delimiter ids inside a tiny vocabulary (the published ones lie past 256)
SMALL_VOCAB_TOKEN_IDS: dict[str, int] = dict(video_token_id=249, image_token_id=250, audio_token_id=251,
                                             boi_token_id=252, eoi_token_id=253, boa_token_id=254,
                                             eoa_token_index=255)


def vision_config() -> Any:
    """A tiny `Gemma4VisionConfig` (GQA, clipped projections, standardized output, 2-D RoPE)."""
    from transformers import Gemma4VisionConfig

    return Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, patch_size=TINY_IMAGE_PROCESSOR["patch_size"],
        pooling_kernel_size=TINY_IMAGE_PROCESSOR["pooling_kernel_size"], position_embedding_size=256,
        use_clipped_linears=True, standardize=True)


def audio_config() -> Any:
    """A tiny `Gemma4AudioConfig`: 128 mel bins in (the feature extractor's), chunks of 4 frames."""
    from transformers import Gemma4AudioConfig

    return Gemma4AudioConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
        conv_kernel_size=5, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
        output_proj_dims=48, use_clipped_linears=True)


def multimodal_model_config(text: Any, vision: bool, audio: bool, token_ids: dict[str, int] | None = None) -> Any:
    """A `Gemma4Config` around `text` with the tiny towers asked for."""
    from transformers import Gemma4Config

    extra: dict[str, Any] = dict(token_ids or {})  # the media token ids, where a test picks its own
    return Gemma4Config(text_config=text.to_dict(), vision_config=vision_config().to_dict() if vision else None,
                        audio_config=audio_config().to_dict() if audio else None, **extra)


def tiny_processor_config() -> dict[str, Any]:
    """The tiny towers' processor settings, shaped as Gemma4Processor's `processor_config.json`."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = Gemma4ImageProcessorPil(**TINY_IMAGE_PROCESSOR).to_dict()
    audio = {k: v for k, v in Gemma4AudioFeatureExtractor().to_dict().items() if k not in ("mel_filters", "window")}
    return {"processor_class": "Gemma4Processor", "image_processor": image, "feature_extractor": audio,
            "video_processor": dict(TINY_VIDEO_PROCESSOR),
            "image_seq_length": TINY_IMAGE_PROCESSOR["max_soft_tokens"], "audio_seq_length": 750,
            "audio_ms_per_token": 40}


def write_processor_config(out_dir: Path, config: dict[str, Any] | None = None) -> None:
    """`processor_config.json` as Gemma4Processor writes it (or `config`): its image processor and feature
    extractor."""
    import json

    config = config if config is not None else tiny_processor_config()
    (out_dir / "processor_config.json").write_text(json.dumps(config, indent=2, default=str))


def text_config(opts: TinyGemma4) -> Any:
    from transformers import Gemma4TextConfig

    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(opts.num_layers)]
    types[-1] = "full_attention"
    heads = 4
    kw: dict[str, Any] = dict(
        vocab_size=opts.vocab_size, hidden_size=opts.hidden_size, intermediate_size=2 * opts.hidden_size,
        num_hidden_layers=opts.num_layers, num_attention_heads=heads, num_key_value_heads=2,
        head_dim=opts.hidden_size // heads, global_head_dim=2 * opts.hidden_size // heads,
        sliding_window=opts.sliding_window, layer_types=types, max_position_embeddings=8192,
        final_logit_softcapping=30.0, hidden_size_per_layer_input=opts.ple_size,
        vocab_size_per_layer_input=opts.vocab_size, num_kv_shared_layers=opts.kv_shared_layers,
        use_double_wide_mlp=opts.double_wide_mlp, attention_k_eq_v=opts.k_eq_v,
        eos_token_id=1, bos_token_id=2, pad_token_id=0,
    )
    if opts.k_eq_v:
        kw["num_global_key_value_heads"] = 1
    if opts.unified:
        if opts.moe or opts.ple_size:
            raise ConfigError("gemma4_unified has no MoE block and no per-layer input embeddings")
        return unified_text_config(kw)
    if opts.moe:
        kw |= dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=opts.hidden_size // 2)
    return Gemma4TextConfig(**kw)


def randomize(model: Any, seed: int = 0, std: float = 0.2) -> Any:
    """Wide random weights and random layer scalars (which transformers' init leaves at 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar") or name.endswith("std_scale"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))
            elif name.endswith("std_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * std)
            elif name.endswith(("input_min", "input_max", "output_min", "output_max")):  # clipped linears: bite
                bound = 1.0 + float(torch.rand((), generator=gen))
                buffer.fill_(-bound if name.endswith("_min") else bound)
    return model


def build(opts: TinyGemma4) -> Any:
    """The transformers model (Gemma4ForCausalLM, or Gemma4ForConditionalGeneration when multimodal; their
    Gemma4Unified* counterparts with `unified`)."""
    from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration

    text = text_config(opts)
    if opts.bidirectional_vision:
        text.use_bidirectional_attention = "vision"
    token_ids = SMALL_VOCAB_TOKEN_IDS if opts.vocab_size <= 256 else None
    model: Any
    if opts.unified and (opts.multimodal or opts.vision or opts.audio):
        from transformers.models.gemma4_unified import Gemma4UnifiedForConditionalGeneration

        model = Gemma4UnifiedForConditionalGeneration(unified_model_config(text, opts.vision, opts.audio, token_ids))
    elif opts.multimodal or opts.vision or opts.audio:
        model = Gemma4ForConditionalGeneration(multimodal_model_config(text, opts.vision, opts.audio, token_ids))
    else:
        model = AutoModelForCausalLM.from_config(text)
    return randomize(model.eval(), opts.seed)


def write_checkpoint(out_dir: Path, opts: TinyGemma4, tokenizer_dir: Path | None,
                     max_shard_size: str = "40MB") -> Path:
    """Write the checkpoint (config, sharded safetensors + index, tokenizer, chat template) to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build(opts)
    logger.info("writing a tiny Gemma 4 (%d layers, hidden %d%s) to %s", opts.num_layers, opts.hidden_size,
                ", MoE" if opts.moe else "", out_dir)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, out_dir / name)
    shutil.copy(CHAT_TEMPLATE, out_dir / "chat_template.jinja")
    if opts.vision or opts.audio:
        write_processor_config(out_dir, unified_processor_config() if opts.unified else None)
    return out_dir


def assistant_config(target: Any, hidden_size: int = 32, num_layers: int = 2, ordered_embeddings: bool = False,
                     num_centroids: int = 64) -> Any:
    """A `Gemma4AssistantConfig` that drafts for `target` (a Gemma4TextConfig): its layers' head dims and KV head
    counts are the target's store layers', its rope and window the target's."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    full, sliding = target.per_layer_config["full_attention"], target.per_layer_config["sliding_attention"]
    types = (["sliding_attention"] * (num_layers - 1) + ["full_attention"]) if num_layers > 1 else ["full_attention"]
    kw: dict[str, Any] = dict(
        vocab_size=target.vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=target.num_attention_heads,
        num_key_value_heads=sliding.num_key_value_heads, head_dim=sliding.head_dim, global_head_dim=full.head_dim,
        num_global_key_value_heads=full.num_key_value_heads, attention_k_eq_v=True,
        sliding_window=target.sliding_window, layer_types=types, rope_parameters=target.rope_parameters,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=target.max_position_embeddings,
    )
    text = Gemma4TextConfig(**kw)
    return Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=target.hidden_size,
                                 use_ordered_embeddings=ordered_embeddings, num_centroids=num_centroids,
                                 centroid_intermediate_top_k=min(8, num_centroids))


def build_assistant(config: Any, seed: int = 0) -> Any:
    """A random `Gemma4AssistantForCausalLM`; with ordered embeddings, a random token order over the centroids."""
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantForCausalLM

    model = randomize(Gemma4AssistantForCausalLM(config).eval(), seed)
    if config.use_ordered_embeddings:
        order = torch.randperm(config.text_config.vocab_size, generator=torch.Generator().manual_seed(seed))
        model.masked_embedding.token_ordering.copy_(order)
    return model


def write_assistant_checkpoint(out_dir: Path, target_dir: Path, seed: int = 0, **options: Any) -> Path:
    """A random assistant for the checkpoint in `target_dir`, written with `save_pretrained`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    target = getattr(config, "text_config", config)
    build_assistant(assistant_config(target, **options), seed).save_pretrained(out_dir)
    return out_dir


def published_like_config(name: str, num_layers: int, vocab_size: int) -> Any:
    """A published size's text config (`published.py`: hidden size, heads, head dims, experts, top-k, widths)
    with `num_layers` layers (sliding, ..., the last full, so both head dims and K=V run) and `vocab_size`."""
    from shared.models.gemma4.published import published_text_config

    types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    return published_text_config(name, num_hidden_layers=num_layers, layer_types=types, vocab_size=vocab_size,
                                 vocab_size_per_layer_input=vocab_size, max_position_embeddings=8192,
                                 eos_token_id=1, bos_token_id=2, pad_token_id=0)


def write_published_like(out_dir: Path, name: str, num_layers: int, vocab_size: int, dtype: torch.dtype,
                         tokenizer_dir: Path | None, seed: int = 0) -> Path:
    """A random checkpoint sized like published `name` but `num_layers` deep, stored as `dtype` (published
    checkpoints are bf16), drawn at transformers' init scale (std 0.02); written to a temporary directory first, so
    an interrupted run leaves no half checkpoint at `out_dir`."""
    from transformers import AutoModelForCausalLM

    config = published_like_config(name, num_layers, vocab_size)
    logger.info("building a random %s with %d layers, vocab %d, %s", name, num_layers, vocab_size, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # in place, in `dtype`: no fp32 copy of a 1.5 GB expert bank at once
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    logger.info("writing it to %s", out_dir)
    model.save_pretrained(partial, max_shard_size="2GB")
    if tokenizer_dir is not None:
        for file in _TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / file, partial / file)
    shutil.copy(CHAT_TEMPLATE, partial / "chat_template.jinja")
    partial.rename(out_dir)
    return out_dir
