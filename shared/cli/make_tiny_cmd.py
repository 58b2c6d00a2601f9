"""`baton make-tiny gemma4`: write a tiny random Gemma 4 checkpoint to serve, test or benchmark with.

    baton make-tiny gemma4 --out DIR [--moe] [--k-eq-v] [--kv-shared-layers N] [--ple-size N]
                           [--double-wide-mlp] [--layers N] [--hidden-size N] [--multimodal] [--seed S]
                           [--vision] [--audio] [--bidirectional-vision] [--unified]
    baton make-tiny gemma4-assistant --target DIR --out ADIR [--ordered-embeddings]
    baton up --model DIR --spec gemma4_assistant --spec-draft-model ADIR

The tokenizer is the packaged Gemma 3 one (same vocabulary), a documented stand-in (shared/models/gemma4/tiny.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.errors import ConfigError
from shared.models.gemma4.tiny import TinyGemma4, write_assistant_checkpoint, write_checkpoint
from shared.models.loader import resolve_model


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("make-tiny", help="write a tiny random checkpoint of an architecture (gemma4)")
    p.add_argument("architecture", choices=["gemma4", "gemma4-assistant"],
                   help="gemma4-assistant: a drafter for the Gemma 4 checkpoint given by --target")
    p.add_argument("--target", type=Path, help="gemma4-assistant: the checkpoint it drafts for")
    p.add_argument("--ordered-embeddings", action="store_true", help="gemma4-assistant: centroid-masked logits")
    p.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    p.add_argument("--moe", action="store_true", help="the MoE block in every layer (8 experts, top 2)")
    p.add_argument("--k-eq-v", action="store_true", help="full-attention layers without v_proj")
    p.add_argument("--kv-shared-layers", type=int, default=0, help="the last N layers reuse earlier K/V")
    p.add_argument("--ple-size", type=int, default=0, help="per-layer input embedding width (0 = none)")
    p.add_argument("--double-wide-mlp", action="store_true", help="KV-shared layers' MLP twice as wide")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--sliding-window", type=int, default=32)
    p.add_argument("--multimodal", action="store_true",
                   help="save as Gemma4ForConditionalGeneration (as published checkpoints are)")
    p.add_argument("--vision", action="store_true", help="with a tiny vision tower (implies --multimodal)")
    p.add_argument("--audio", action="store_true", help="with a tiny audio tower (implies --multimodal)")
    p.add_argument("--bidirectional-vision", action="store_true",
                   help="an image's soft tokens attend to each other on sliding layers")
    p.add_argument("--unified", action="store_true",
                   help="the 12B model's layout (gemma4_unified): no PLE or MoE; --vision / --audio add its "
                        "encoder-free embedders (images seen both ways on every layer, as published)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="40MB", help="safetensors shard size (default 40MB)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.set_defaults(func=run_make_tiny)


def run_make_tiny(args: argparse.Namespace) -> int:
    if args.architecture == "gemma4-assistant":
        if args.target is None:
            raise ConfigError("make-tiny gemma4-assistant needs --target (the Gemma 4 checkpoint it drafts for)")
        print(write_assistant_checkpoint(args.out, args.target, args.seed, hidden_size=args.hidden_size,
                                         ordered_embeddings=args.ordered_embeddings))
        return 0
    opts = TinyGemma4(num_layers=args.layers, hidden_size=args.hidden_size, moe=args.moe, k_eq_v=args.k_eq_v,
                      kv_shared_layers=args.kv_shared_layers, ple_size=args.ple_size,
                      double_wide_mlp=args.double_wide_mlp, sliding_window=args.sliding_window,
                      multimodal=args.multimodal, vision=args.vision, audio=args.audio,
                      bidirectional_vision=args.bidirectional_vision, unified=args.unified, seed=args.seed)
    tokenizer_dir = resolve_model("gemma3-270m", args.cache_dir)
    print(write_checkpoint(args.out, opts, tokenizer_dir, args.max_shard_size))
    return 0
