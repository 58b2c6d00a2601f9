"""`baton train-draft`: train an EAGLE head for a model (on the CPU, or `--device cuda`), save it for `--spec eagle`.

    bundled prompts ─► target generates replies ─► prefill-role engine hands out hidden states
        ─► train the head (progress bar) ─► safetensors ─► acceptance length on held-out prompts

Everything runs in-process on one loaded model: the hidden states come from
the same prefill path (`KVHandoff.hidden_states`) that feeds a decode engine's
EAGLE proposer when serving.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine, pick_attention
from shared.engine.request import SamplingParams
from shared.models.loader import LoadedModel, load_model
from shared.spec.eagle import target_lm_head
from shared.spec.eagle_head import EagleHead, EagleHeadConfig
from shared.spec.eagle_train import (
    TrainingSequence,
    draft_vocabulary,
    extract_hidden_states,
    generate_sequences,
    load_training_data,
    save_training_data,
    train_head,
)
from shared.spec.synth_prompts import synthesize_requests
from shared.spec.train_prompts import ALL_TRAIN_PROMPTS, EVAL_PROMPTS
from shared.tokenizer import encode_prompt

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train-draft", help="train an EAGLE draft head for a model (CPU or CUDA) and save it")
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory")
    p.add_argument("--out", type=Path, required=True, help="safetensors file to write")
    p.add_argument("--num-prompts", type=int, default=len(ALL_TRAIN_PROMPTS), help="bundled prompts to use")
    p.add_argument("--synth-prompts", type=int, default=0,
                   help="also sample this many user requests from the model itself (chat models; ~78%% kept)")
    p.add_argument("--max-tokens", type=int, default=128, help="reply length the target generates per prompt")
    p.add_argument("--samples-per-prompt", type=int, default=2, help="one greedy reply, the rest sampled")
    p.add_argument("--steps", type=int, default=1300)
    p.add_argument("--window", type=int, default=64, help="rows per training window (= serving hidden window)")
    p.add_argument("--batch-windows", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ce-weight", type=float, default=0.1, help="weight of the token loss next to the feature loss")
    p.add_argument("--draft-vocab", type=int, default=4096, help="most frequent tokens the head may propose")
    p.add_argument("--eval-tokens", type=int, default=64, help="reply length when measuring acceptance")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--depth", type=int, default=3, help="draft steps trained per window (1: teacher forcing only)")
    p.add_argument("--device", default="cpu", help="where generation and training run (cpu, cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--data-cache", type=Path, help="reuse (or write) the generated text and hidden states here")
    p.set_defaults(func=run_train_draft)


def _engine(args: argparse.Namespace, loaded: object = None, **config: object) -> LLMEngine:
    kw: dict[str, object] = dict(model=args.model, max_model_len=1024, kv_cache_bytes=256 << 20,
                                 cache_dir=args.cache_dir, device=args.device)
    kw.update(config)
    return LLMEngine(EngineConfig(**kw), loaded=loaded)  # type: ignore[arg-type]


def _training_data(args: argparse.Namespace, loaded: LoadedModel) -> list[TrainingSequence]:
    if args.data_cache is not None and args.data_cache.is_file():
        logger.info("reusing training data from %s", args.data_cache)
        return load_training_data(args.data_cache)
    # room for every running request's prompt and reply (~46 KiB per token on SmolLM2): no preemption
    on_gpu = args.device != "cpu"
    generator_engine = _engine(args, loaded, kv_cache_bytes=(4 << 30) if on_gpu else (768 << 20),
                               max_num_seqs=256 if on_gpu else 64)
    chat = loaded.chat_template is not None
    texts = list(ALL_TRAIN_PROMPTS[: args.num_prompts])
    if args.synth_prompts > 0:
        texts += synthesize_requests(generator_engine, args.synth_prompts, seed=args.seed, exclude=EVAL_PROMPTS)
    prompts = [encode_prompt(loaded.tokenizer, p, chat=chat) for p in texts]
    logger.info("generating %d x %d replies of up to %d tokens with %s", len(prompts), args.samples_per_prompt,
                args.max_tokens, args.model)
    sequences = generate_sequences(generator_engine, prompts, args.max_tokens, args.samples_per_prompt)
    del generator_engine
    logger.info("extracting hidden states through the prefill path")
    data = extract_hidden_states(_engine(args, loaded, role="prefill", enable_prefix_caching=False), sequences)
    if args.data_cache is not None:
        save_training_data(data, args.data_cache)
    return data


def run_train_draft(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    loaded = load_model(args.model, pick_attention("auto", args.device), device=args.device, max_model_len=1024,
                        cache_dir=args.cache_dir)
    data = _training_data(args, loaded)
    num_tokens = sum(s.token_ids.shape[0] for s in data)

    model = loaded.model
    head = EagleHead(EagleHeadConfig.from_decoder_spec(model.spec), model.embed, target_lm_head(model),
                     generator=torch.Generator().manual_seed(args.seed),
                     draft_token_ids=draft_vocabulary(data, args.draft_vocab))
    bar = tqdm(total=args.steps, desc="train-draft", file=sys.stderr, unit="step")

    def progress(step: int, loss: float, acc: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", top1=f"{acc:.2f}")

    accuracy = train_head(head, data, args.steps, args.window, args.batch_windows, args.lr, progress, args.seed,
                          args.ce_weight, args.depth)
    bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    head.save(args.out)
    logger.info("saved %s (teacher-forced top-1 %.2f over %d training tokens)", args.out, accuracy, num_tokens)

    acceptance = measure_acceptance(args, loaded)
    report = {"out": str(args.out), "model": args.model, "training_tokens": num_tokens, "steps": args.steps,
              "draft_vocab": int(head.draft_token_ids.shape[0]) if head.draft_token_ids is not None else None,
              "depth": args.depth, "train_top1": accuracy, "eval_mean_acceptance_length": acceptance,
              "num_speculative_tokens": args.num_speculative_tokens, "elapsed_s": time.monotonic() - t0}
    print(json.dumps(report))
    return 0


def measure_acceptance(args: argparse.Namespace, loaded: object) -> float:
    """Mean acceptance length (accepted drafts + 1 per step) on held-out chat prompts, greedy."""
    engine = _engine(args, loaded, spec_method="eagle", spec_eagle_head=args.out,
                     num_speculative_tokens=args.num_speculative_tokens)
    chat = engine.loaded.chat_template is not None
    prompts = [encode_prompt(engine.loaded.tokenizer, p, chat=chat) for p in EVAL_PROMPTS]
    engine.generate(prompts, SamplingParams(max_tokens=args.eval_tokens, temperature=0.0))
    assert engine.speculator is not None
    stats = engine.speculator.stats
    logger.info("held-out acceptance: %.2f tokens per step (%d of %d drafts accepted)",
                stats.mean_acceptance_length, stats.num_accepted_tokens, stats.num_draft_tokens)
    return stats.mean_acceptance_length
