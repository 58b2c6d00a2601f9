"""The projections of a GGUF file in their own block format (`--quantization gguf`).

The rest of the model (embeddings, norms) comes from the fp32 HF directory the
loader converts the file to once; only the projections are taken as the file's
blocks (its tensor table: `gguf_tensors.py`), never dequantized
(`shared/ops/quant.py`, `shared/ops/kquant.py`):

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

import torch

from shared.errors import ConfigError
from shared.models.decoder import DecoderSpec
from shared.models.gguf_tensors import read_gguf_tensors
from shared.ops.kquant import KQuantCodes, concat_codes, gguf_codes
from shared.ops.quant import QuantCodes

logger = logging.getLogger(__name__)


Codes = QuantCodes | KQuantCodes


def _unpermute_rows(codes: Codes, num_heads: int) -> Codes:
    """transformers' reverse_permute_weights, on whole rows of blocks."""
    n = codes.codes.shape[0]
    # row (h, a, b) of [heads, 2, half] is the file's row (h, b, a) of [heads, half, 2]
    return codes.rows(torch.arange(n).reshape(num_heads, n // num_heads // 2, 2).transpose(1, 2).reshape(n))


def read_gguf_projections(path: Path, spec: DecoderSpec) -> dict[str, Codes]:
    """Our projection names -> their codes, from the file's blocks."""
    try:
        tensors, arch = read_gguf_tensors(path)
    except ValueError as exc:
        raise ConfigError(f"--quantization gguf: {exc}") from None

    def codes(name: str) -> Codes:
        t = tensors.get(name)
        if t is None:
            raise ConfigError(f"{path.name} has no tensor {name}")
        k, n = (int(x) for x in t.shape[:2])  # ggml order: [in, out]
        try:
            return gguf_codes(t.type_name, t.data, (n, k))
        except ValueError as exc:
            raise ConfigError(f"--quantization gguf: {path.name}'s {name}: {exc}") from None

    def rows(what: str, parts: list[Codes]) -> Codes:
        try:
            return concat_codes(parts)
        except ValueError as exc:
            raise ConfigError(f"--quantization gguf: {path.name}'s {what}: {exc}") from None

    out: dict[str, Codes] = {}
    for i in range(spec.num_layers):
        q, k, v = (codes(f"blk.{i}.attn_{x}.weight") for x in "qkv")
        if arch == "llama":
            q, k = _unpermute_rows(q, spec.num_heads), _unpermute_rows(k, spec.num_kv_heads)
        p = f"model.layers.{i}."
        out[p + "qkv"] = rows(f"layer {i} q, k, v", [q, k, v])
        out[p + "o"] = codes(f"blk.{i}.attn_output.weight")
        out[p + "gate_up"] = rows(f"layer {i} gate, up", [codes(f"blk.{i}.ffn_{x}.weight") for x in ("gate", "up")])
        out[p + "down"] = codes(f"blk.{i}.ffn_down.weight")
    out["lm_head"] = codes("output.weight" if "output.weight" in tensors else "token_embd.weight")
    fmts = sorted({c.fmt for c in out.values()})
    logger.info("serving %s's projections in their GGUF blocks (%s)", path.name, ", ".join(fmts))
    return out
