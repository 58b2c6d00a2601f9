"""`baton generate` and `baton export-hf`: run the engine in-process on one prompt."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import uuid
from pathlib import Path

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.errors import InvalidRequestError
from shared.models.loader import resolve_model
from shared.tokenizer import decode, encode_prompt


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("generate", help="generate text for one prompt with the in-process engine")
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template file (for models without one)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--json", action="store_true", help="last stdout line: {token_ids, text, finish_reason}")
    p.set_defaults(func=run_generate)

    e = sub.add_parser("export-hf", help="write a model (alias or GGUF) as an fp32 HF directory")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    e.set_defaults(func=run_export)


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, ignore_eos=args.ignore_eos,
    )
    if not args.prompt:
        raise InvalidRequestError("prompt is empty")
    template = args.chat_template.read_text() if args.chat_template else None
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=args.max_model_len, cache_dir=args.cache_dir,
                                    kv_cache_bytes=256 << 20))
    prompt_ids = encode_prompt(engine.loaded.tokenizer, args.prompt, chat=args.chat or bool(template),
                               chat_template=template)
    request_id = f"cli-{uuid.uuid4().hex[:8]}"
    engine.add_request(request_id, prompt_ids, params)
    token_ids: list[int] = []
    finish_reason = None
    printed = ""
    while engine.has_unfinished():
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
            finish_reason = out.finish_reason if out.finished else finish_reason
            if not args.json:  # stream text as it forms (decode the whole, print the new suffix)
                text = decode(engine.loaded.tokenizer, token_ids)
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    engine.close()
    text = decode(engine.loaded.tokenizer, token_ids)
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "finish_reason": finish_reason}))
    else:
        print()
    return 0


def run_export(args: argparse.Namespace) -> int:
    src = resolve_model(args.model, args.cache_dir)
    shutil.copytree(src, args.out, dirs_exist_ok=True)
    print(args.out)
    return 0
