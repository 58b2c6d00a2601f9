"""What an engine announces at kv_transfer's Reserve for a run of tokens: a slot per unit, full ones named.

Prefill reserves for a prompt it is about to compute; a decode engine for the context of a request it
preempts (kv_spill.py), so both name the same blocks by the same prefix hashes and the pool treats them alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from shared.engine.block_pool import hash_prefix_blocks
from shared.kv.remote import HandoffSpec, unit_hashes
from shared.multimodal.items import MediaInput, MediaItem

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig
    from shared.engine.kv_manager import KVCacheManager
    from shared.kv.layout import KVLayout
    from shared.models.loader import LoadedModel


class SpecEngine(Protocol):
    """What `handoff_spec` reads of an engine (LLMEngine)."""

    config: EngineConfig
    loaded: LoadedModel
    layout: KVLayout
    kv: KVCacheManager


def handoff_spec(engine: SpecEngine, handoff_id: str, request_id: str, token_ids: Sequence[int],
                 media: Sequence[MediaInput] | Sequence[MediaItem] = (), hidden_nbytes: int = 0,
                 capability: str = "") -> HandoffSpec:
    """The spec for `token_ids`: one slot per unit (a block of one layer group; sliding groups only inside the
    window the next query sees), the full ones named by their chained prefix hash (`media` joins it)."""
    tokens = list(token_ids)
    layout = replace(engine.layout, num_blocks=len(engine.layout.handoff_units(len(tokens))), group_blocks=())
    hashes = unit_hashes(layout, hash_prefix_blocks(tokens, engine.config.block_size, engine.kv.hash_salt, media),
                         len(tokens))
    return HandoffSpec(handoff_id, request_id, engine.loaded.identity, layout, tokens, hashes, hidden_nbytes,
                       capability=capability)
