"""What prefix blocks an instance holds, in a form small enough to ride on every load report.

An engine names each full KV block by a chained hash (shared/engine/block_pool.py): the hash of block i
covers the tokens of blocks 0..i and the engine's salt (its model identity), so one hash names a whole
prefix. An instance publishes the hashes it holds; the router hashes a prompt the same way and counts
how many of its leading blocks an instance already holds:

```
 prompt tokens  [ b0 | b1 | b2 | b3 | tail ]      chained: h0 = H(salt, b0), h1 = H(h0, b1), ...
 held (summary)  {h0, h1, h7, ...}
 leading hit    h0 ✓  h1 ✓  h2 ✗  → 2 blocks (2 × block_size tokens) need no prefill
```

The summary is bounded (`MAX_SUMMARY_BLOCKS`, the most recently cached first) and each hash is cut to
`KEY_BYTES` bytes (hex in the registry's JSON, raw bytes on the wire): a false hit needs a 64-bit
collision, and a miss only costs a less informed pick, never a wrong answer (the engine re-checks
token ids on every real hit).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from shared.engine.block_pool import hash_prefix_blocks

MAX_SUMMARY_BLOCKS = 2048  # ~37 KB of JSON per instance per heartbeat
KEY_BYTES = 8


@dataclass(frozen=True)
class KVSummary:
    """The prefix blocks one instance holds (empty for an instance that published none)."""

    block_size: int = 0  # tokens per block; 0 when the instance does not hash prompts itself (kv_transfer)
    hash_salt: str = ""  # what the instance's block hashes name besides the tokens (model, KV dtype, format)
    block_hashes: tuple[str, ...] = ()  # hex of the first KEY_BYTES bytes of each held block's chained hash

    def held(self) -> frozenset[str]:
        return frozenset(self.block_hashes)


def block_key(block_hash: bytes) -> str:
    """How a block hash appears in a summary."""
    return block_hash[:KEY_BYTES].hex()


def summarize(
    block_hashes: Iterable[bytes], block_size: int = 0, hash_salt: str = "", max_blocks: int = MAX_SUMMARY_BLOCKS
) -> KVSummary:
    """A summary of the first `max_blocks` of `block_hashes` (pass the most recently cached first)."""
    keys: list[str] = []
    for block_hash in block_hashes:
        if len(keys) >= max_blocks:
            break
        keys.append(block_key(block_hash))
    return KVSummary(block_size=block_size, hash_salt=hash_salt, block_hashes=tuple(keys))


def prompt_block_keys(prompt_token_ids: Sequence[int], block_size: int, hash_salt: str) -> list[str]:
    """The summary keys of the prompt's full blocks, as an engine with this block size and salt names them."""
    if block_size <= 0:
        return []
    return [block_key(h) for h in hash_prefix_blocks(prompt_token_ids, block_size, hash_salt.encode())]


def leading_hits(prompt_keys: Sequence[str], held: Container[str]) -> int:
    """How many of the prompt's first blocks are held, counted until the first one that is not."""
    num_blocks = 0
    for key in prompt_keys:
        if key not in held:
            break
        num_blocks += 1
    return num_blocks
