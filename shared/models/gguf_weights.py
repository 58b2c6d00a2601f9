"""The projections of a GGUF file in their own block format (`--quantization gguf`), read with `gguf`.

The rest of the model (embeddings, norms) comes from the fp32 HF directory the
loader converts the file to once; only the projections are taken as the file's
blocks, never dequantized (`shared/ops/quant.py`):

    blk.{i}.attn_q / attn_k / attn_v  ─rows─►  model.layers.{i}.qkv
    blk.{i}.attn_output                ────►  model.layers.{i}.o
    blk.{i}.ffn_gate / ffn_up          ─rows─►  model.layers.{i}.gate_up
    blk.{i}.ffn_down                   ────►  model.layers.{i}.down
    output (or token_embd when tied)   ────►  lm_head

llama.cpp's converter permutes the rows of Llama's q and k projections (its
RoPE pairs neighbours; ours and transformers' pair halves); the rows are put
back as transformers does when it dequantizes, which moves whole rows of blocks.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from shared.errors import ConfigError
from shared.models.decoder import DecoderSpec
from shared.ops.quant import QuantCodes, concat_rows, from_gguf_blocks

logger = logging.getLogger(__name__)


def _unpermute_rows(codes: QuantCodes, num_heads: int) -> QuantCodes:
    """transformers' reverse_permute_weights, on whole rows of blocks."""
    n = codes.codes.shape[0]
    # row (h, a, b) of [heads, 2, half] is the file's row (h, b, a) of [heads, half, 2]
    return codes.rows(torch.arange(n).reshape(num_heads, n // num_heads // 2, 2).transpose(1, 2).reshape(n))


def read_gguf_projections(path: Path, spec: DecoderSpec) -> dict[str, QuantCodes]:
    """Our projection names -> their codes, from the file's blocks."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""

    def codes(name: str) -> QuantCodes:
        t = tensors.get(name)
        if t is None:
            raise ConfigError(f"{path.name} has no tensor {name}")
        k, n = (int(x) for x in t.shape[:2])  # ggml order: [in, out]
        try:
            return from_gguf_blocks(t.tensor_type.name, np.asarray(t.data), (n, k))
        except ValueError as exc:
            raise ConfigError(f"--quantization gguf: {path.name}'s {name}: {exc}") from None

    out: dict[str, QuantCodes] = {}
    for i in range(spec.num_layers):
        q, k, v = (codes(f"blk.{i}.attn_{x}.weight") for x in "qkv")
        if arch == "llama":
            q, k = _unpermute_rows(q, spec.num_heads), _unpermute_rows(k, spec.num_kv_heads)
        p = f"model.layers.{i}."
        out[p + "qkv"] = concat_rows([q, k, v])
        out[p + "o"] = codes(f"blk.{i}.attn_output.weight")
        out[p + "gate_up"] = concat_rows([codes(f"blk.{i}.ffn_gate.weight"), codes(f"blk.{i}.ffn_up.weight")])
        out[p + "down"] = codes(f"blk.{i}.ffn_down.weight")
    out["lm_head"] = codes("output.weight" if "output.weight" in tensors else "token_embd.weight")
    fmts = sorted({c.fmt for c in out.values()})
    logger.info("serving %s's projections in their GGUF blocks (%s)", path.name, ", ".join(fmts))
    return out
