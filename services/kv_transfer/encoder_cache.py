"""Encoder outputs shared by every prefill instance: an LRU of soft-token tensors by (model, media digest).

    prefill A encodes image X ──PutEncoderOutputs(model, X: [n, hidden])──► EncoderOutputCache
    prefill B is sent X again ──GetEncoderOutputs(model, [X])─────────────► [n, hidden] bytes: no encode

Bounded by bytes: the least recently used outputs go first; one output larger
than the whole bound is not kept. Entries are opaque bytes with their dtype and
shape (the service never builds a tensor). Single-threaded, like the store:
call it from the service's event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class EncoderOutputEntry:
    content_hash: bytes
    dtype: str
    shape: tuple[int, ...]
    data: bytes


class EncoderOutputCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[str, bytes], EncoderOutputEntry] = OrderedDict()
        self.nbytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, model: str, content_hashes: list[bytes]) -> list[EncoderOutputEntry]:
        """The entries held for these digests, in order (the others left out); each hit becomes the newest."""
        found = []
        for h in content_hashes:
            entry = self._entries.get((model, h))
            if entry is None:
                self.num_misses += 1
                continue
            self._entries.move_to_end((model, h))
            self.num_hits += 1
            found.append(entry)
        return found

    def put(self, model: str, entries: list[EncoderOutputEntry]) -> int:
        """Keep these entries (replacing any under the same key); returns how many were kept."""
        kept = 0
        for entry in entries:
            size = len(entry.data)
            if size > self.capacity_bytes:
                continue
            old = self._entries.pop((model, entry.content_hash), None)
            if old is not None:
                self.nbytes -= len(old.data)
            while self.nbytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= len(evicted.data)
                self.num_evicted += 1
            self._entries[(model, entry.content_hash)] = entry
            self.nbytes += size
            kept += 1
        return kept
