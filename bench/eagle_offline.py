"""An EAGLE head's acceptance without serving: the chain it would draft at every position of a greedy reply.

For each held-out chat prompt (the ones train-draft and bench/spec_decode.py
report on) the target writes its greedy reply and the prefill path gives its
hidden states, as train-draft's own data. Then at every position of the reply
the head drafts `--drafts` tokens from the last `--window` rows
(`chain_predictions`, tested equal to serving's chained drafting) and counts
how many match the reply before the first miss: mean acceptance length = 1 +
that count, as a decode step would emit it. Every position counts once, with
none of serving's scheduling, so heads and settings compare on the same
footing in a few minutes, and `--vocab` asks what a wider draft vocabulary
would accept (`full`: all tokens; `context`: the head's plus the request's own
tokens).

`--tree CHOICES` also scores a draft tree (shared/spec/tree.py): at each
position the rank of the reply's token among the head's guesses at every depth
(given the reply so far, which is what every accepted branch holds), and the
deepest node whose rank path it follows.

`--train-data FILE` (a train-draft `--data-cache`) also scores the first
`--train-sequences` of its sequences (in train-draft's order, the written
prompts' replies, greedy and sampled in turn); where a reply was sampled, not
greedy, a draft must match the text that follows, so that figure understates.

    python bench/eagle_offline.py [--head PATH] [--window 16] [--drafts 3] [--vocab draft|full|context]
                                  [--tree "0;1;2;0.0;0.1;1.0;0.0.0;0.0.0.0"]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine, pick_attention
from shared.engine.request import SamplingParams
from shared.models.loader import LoadedModel, load_model
from shared.spec.eagle import target_lm_head
from shared.spec.eagle_head import EagleHead
from shared.spec.eagle_train import (
    TrainingSequence,
    chain_predictions,
    extract_hidden_states,
    load_training_data,
)
from shared.spec.train_prompts import EVAL_PROMPTS
from shared.spec.tree import DraftTree
from shared.tokenizer import encode_prompt


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def held_out(loaded: LoadedModel, model: str, max_tokens: int) -> tuple[list[TrainingSequence], list[int]]:
    """The target's greedy replies to the held-out prompts with their hidden states; and each prompt's length."""
    def engine(**kw: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, max_model_len=1024, kv_cache_bytes=256 << 20, **kw), loaded=loaded)

    prompts = [encode_prompt(loaded.tokenizer, p, chat=loaded.chat_template is not None) for p in EVAL_PROMPTS]
    replies = engine().generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    sequences = [p + r.token_ids for p, r in zip(prompts, replies, strict=True)]
    return extract_hidden_states(engine(role="prefill", enable_prefix_caching=False), sequences), [len(p) for p in prompts]


_MISS = 1 << 30  # the rank of a token the head cannot propose there (or of sampled text: no greedy pick)


def _index(candidates: torch.Tensor | None, token: int) -> int | None:
    """Where `token` is among the head's candidates (None: it is not one)."""
    if candidates is None:
        return token
    hit = (candidates == token).nonzero()
    return int(hit[0, 0]) if hit.numel() else None


@torch.no_grad()
def score(head: EagleHead, sequences: list[TrainingSequence], starts: list[int], window: int, drafts: int,
          vocab: str, tree: DraftTree | None = None) -> dict[str, Any]:
    """Mean acceptance length and the share of positions accepting each draft, over every reply position
    from `starts[i]` on that has `drafts` tokens after it; with `tree`, the tree's acceptance length too."""
    draft_ids = head.draft_token_ids
    # the tokens a draft may be and their LM-head rows; vocab "context" widens them per position
    candidates = None if vocab == "full" or draft_ids is None else draft_ids
    rows = head.lm_head if candidates is None else head.lm_head[candidates]
    depth = max(drafts, tree.max_depth if tree is not None else 0)
    ranks = []  # per position: the reply token's rank among the head's guesses at each depth
    for seq, start in zip(sequences, starts, strict=True):
        n = seq.token_ids.shape[0]
        for r in range(start - 1, n - depth - 1):  # drafting after position r + 1, the last known token
            preds = chain_predictions(head, seq, torch.arange(max(0, r - window + 1), r + 1), depth)
            if vocab == "context" and draft_ids is not None:
                candidates = torch.unique(torch.cat([draft_ids, seq.token_ids[: r + 2]]))
                rows = head.lm_head[candidates]
            position = []
            for k in range(depth):
                token = int(seq.token_ids[r + k + 2])
                scores = preds[k][-1] @ rows.T
                at = _index(candidates, token)
                # greedy verification keeps a draft only where it is the target's pick, which the text holds
                # only where the reply was greedy
                greedy = token == int(seq.greedy_next[r + k + 1])
                position.append(int((scores > scores[at]).sum()) if greedy and at is not None else _MISS)
            ranks.append(position)
    positions = max(len(ranks), 1)
    accepted_at = [sum(all(rank == 0 for rank in pos[: k + 1]) for pos in ranks) for k in range(drafts)]
    result: dict[str, Any] = {"positions": len(ranks), "mean_acceptance_length": 1 + sum(accepted_at) / positions,
                              "accepted_share_per_draft": [a / positions for a in accepted_at]}
    if tree is not None:
        paths = {tuple(tree.ranks[node] for node in tree.ancestors(i)[1:]) for i in range(len(tree.parents))}
        deepest = [max(d for d in range(depth + 1) if tuple(pos[:d]) in paths) for pos in ranks]
        result["tree"] = {"choices_nodes": tree.num_drafts, "mean_acceptance_length": 1 + sum(deepest) / positions}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--head", type=Path, help="default: ~/.cache/baton/eagle/<model>.safetensors")
    parser.add_argument("--window", type=int, default=16, help="hidden-state rows the head drafts over")
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--vocab", choices=["draft", "full", "context"], default="draft")
    parser.add_argument("--tree", help="also score this draft tree (rank paths, e.g. '0;1;0.0;0.0.0')")
    parser.add_argument("--max-tokens", type=int, default=64, help="reply length per held-out prompt")
    parser.add_argument("--train-data", type=Path, help="a train-draft --data-cache to score as well")
    parser.add_argument("--train-sequences", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    head_path = args.head or DEFAULT_CACHE_DIR / "eagle" / f"{args.model}.safetensors"

    log(f"loading {args.model} and {head_path} ...")
    loaded = load_model(args.model, pick_attention("auto", "cpu"), max_model_len=1024)
    model = loaded.model
    head = EagleHead.load(head_path, model.embed, target_lm_head(model)).eval()
    tree = DraftTree.parse(args.tree) if args.tree else None
    sequences, starts = held_out(loaded, args.model, args.max_tokens)
    result: dict[str, Any] = {
        "bench": "eagle_offline", "model": args.model, "head": str(head_path), "window": args.window,
        "drafts": args.drafts, "vocab": args.vocab, "max_tokens": args.max_tokens,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "tree": args.tree,
        "held_out": score(head, sequences, starts, args.window, args.drafts, args.vocab, tree),
    }
    log(f"held-out: {result['held_out']}")
    if args.train_data is not None:
        train = load_training_data(args.train_data, args.train_sequences)
        # score the replies: the last max_tokens positions of each (train-draft's replies are 128 tokens)
        train_starts = [max(1, s.token_ids.shape[0] - 128) for s in train]
        result["train"] = score(head, train, train_starts, args.window, args.drafts, args.vocab, tree)
        log(f"train: {result['train']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"eagle_offline-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    log(f"wrote {path}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
