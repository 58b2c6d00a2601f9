"""The metadata blob an agent hands to its peers, the same envelope for every backend::

    b"BATONMD1" | u32 header_nbytes | header (JSON) | backend blob
    header = {"kind": "nixl"|"ucxx"|"tcp", "name": str, "regions": [[addr, nbytes, mem_type, device_id], ...]}

The backend blob is what the backend itself needs to connect: NIXL's agent
metadata, a UCX worker address, or "host:port" for TCP. The regions let the
initiator reject a descriptor outside the target's memory before anything
goes on the wire, the same way for all three backends.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from shared.transport.base import MemoryRegion, MemType, TransportError

MAGIC = b"BATONMD1"
MAX_HEADER_NBYTES = 16 << 20
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class AgentMetadata:
    kind: str
    name: str
    regions: tuple[MemoryRegion, ...]
    blob: bytes

    def encode(self) -> bytes:
        regions = [[r.addr, r.nbytes, r.mem_type.value, r.device_id] for r in self.regions]
        header = json.dumps({"kind": self.kind, "name": self.name, "regions": regions}).encode()
        return MAGIC + _LEN.pack(len(header)) + header + self.blob

    @classmethod
    def decode(cls, data: bytes) -> AgentMetadata:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
            raise TransportError("not a baton transport metadata blob")
        (header_nbytes,) = _LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LEN.size
        if header_nbytes > MAX_HEADER_NBYTES or start + header_nbytes > len(data):
            raise TransportError("truncated or oversized transport metadata")
        try:
            header = json.loads(data[start:start + header_nbytes])
            regions = tuple(
                MemoryRegion(int(addr), int(nbytes), MemType(mem_type), int(device_id))
                for addr, nbytes, mem_type, device_id in header["regions"]
            )
            kind, name = str(header["kind"]), str(header["name"])
        except (ValueError, KeyError, TypeError) as e:
            raise TransportError(f"malformed transport metadata: {e}") from e
        return cls(kind, name, regions, bytes(data[start + header_nbytes:]))
