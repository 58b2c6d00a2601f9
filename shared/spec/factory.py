"""Build the engine's speculator from its config: one place that knows every method."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.errors import ConfigError
from shared.models.decoder import DecoderSpec
from shared.spec.grammar_drafts import MAX_FORCED_DRAFTS, GrammarDrafter
from shared.spec.ngram import NgramProposer
from shared.spec.proposer import ProposalInput, Proposer
from shared.spec.speculator import Speculator
from shared.spec.tree import DraftTree

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig
    from shared.engine.logits.grammars import GrammarCache
    from shared.models.loader import LoadedModel

logger = logging.getLogger(__name__)

__all__ = ["build_speculator"]


class NoProposer:
    """Proposes nothing: the speculator of an engine that drafts only what grammars force."""

    proposes_ahead = True
    proposes_nothing = True

    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        return [[] for _ in requests]


def build_speculator(
    config: EngineConfig, loaded: LoadedModel, max_model_len: int, num_kv_blocks: int,
    grammars: GrammarCache | None = None,
) -> Speculator | None:
    """None when nothing drafts (speculation and grammar fast-forward off) or the role never decodes (prefill).

    `grammars`: the engine's compiled grammars, for fast-forward drafts (shared/spec/grammar_drafts.py).
    """
    if config.role == "prefill":
        return None
    drafter = None
    if config.grammar_fast_forward and grammars is not None and loaded.tokenizer is not None:
        drafter = GrammarDrafter(grammars, loaded.tokenizer)
    if config.spec_method == "none":
        if drafter is None:
            return None
        logger.info("speculative decoding: grammar fast-forward drafts only")
        return Speculator(NoProposer(), MAX_FORCED_DRAFTS, max_model_len, loaded.spec.vocab_size,
                          grammar_drafter=drafter, grammar_max_batch=config.grammar_fast_forward_max_batch)
    proposer: Proposer
    if config.spec_method in ("draft", "eagle") and not isinstance(loaded.spec, DecoderSpec):
        raise ConfigError(f"spec method {config.spec_method!r} drafts for Llama and Gemma 3 models, not "
                          f"{loaded.spec.model_type}")
    if config.spec_method == "ngram":
        proposer = NgramProposer()
    elif config.spec_method == "draft":
        from shared.spec.draft_model import build_draft_proposer

        proposer = build_draft_proposer(config, loaded, num_kv_blocks)
    elif config.spec_method == "gemma4_assistant":
        from shared.spec.gemma4_assistant import build_assistant_proposer

        proposer = build_assistant_proposer(config, loaded)
    else:
        from shared.spec.eagle import build_eagle_proposer

        proposer = build_eagle_proposer(config, loaded)
    logger.info("speculative decoding: %s, %d tokens per step", config.spec_method, config.num_speculative_tokens)
    tree = DraftTree.parse(config.spec_tree) if config.spec_tree is not None else None
    if tree is not None:
        logger.info("greedy requests draft a tree of %d nodes, %d deep", tree.num_drafts, tree.max_depth)
    return Speculator(proposer, config.num_speculative_tokens, max_model_len, loaded.spec.vocab_size,
                      hidden_window=config.spec_eagle_window, disable_batch_size=config.spec_disable_batch_size,
                      tree=tree, grammar_drafter=drafter, grammar_max_batch=config.grammar_fast_forward_max_batch)
