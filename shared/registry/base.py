"""What an instance tells the registry about itself, and the `Registry` seam.

Every baton service keeps one entry alive in the registry while it runs:

```
 service start ──register(info, ttl_s)──► entry live (expires ttl_s later)
      │
      ├── every ttl_s/3: heartbeat(info with fresh load) ──► expiry pushed back
      │
      ├── drain: heartbeat(info with draining=True) ──► pickers stop choosing it
      │
      └── stop: deregister(service, instance_id) ──► entry gone at once
 crash / hang / partition: heartbeats stop ──► entry lapses after ttl_s ──► forgotten
```

`list(service)` returns only live entries; the router asks it, then chooses with
the pure functions in `picker.py`. Two implementations share these semantics:
`RedisRegistry` (anything with more than one host) and `MemoryRegistry` (one
process, tests, `baton up` without a Redis URL).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from shared.errors import ConfigError
from shared.registry.kv_summary import KVSummary

ServiceName = Literal["prefill", "decode", "kv_transfer", "router", "colocated", "encoder"]
SERVICE_NAMES: frozenset[str] = frozenset({"prefill", "decode", "kv_transfer", "router", "colocated", "encoder"})


def check_ttl(ttl_s: float) -> None:
    """Raise `ConfigError` unless `ttl_s` is a positive number of seconds."""
    if not ttl_s > 0:
        raise ConfigError(f"ttl_s must be > 0, got {ttl_s!r}")


def check_service(service: str) -> None:
    """Raise `ConfigError` unless `service` is one of `SERVICE_NAMES`."""
    if service not in SERVICE_NAMES:
        raise ConfigError(f"unknown service {service!r}; expected one of {sorted(SERVICE_NAMES)}")


@dataclass(frozen=True)
class Load:
    """An instance's load at its last heartbeat (engine counters, not estimates)."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_free: int = 0  # held by no request; cached-but-unreferenced blocks count as free

    @property
    def kv_free_fraction(self) -> float:
        """Free KV blocks over total, in [0, 1]; 0 for an instance without a KV cache."""
        if self.num_kv_blocks_total <= 0:
            return 0.0
        return min(1.0, max(0.0, self.num_kv_blocks_free / self.num_kv_blocks_total))


@dataclass(frozen=True)
class InstanceInfo:
    """One registered service instance."""

    service: str  # one of SERVICE_NAMES: "prefill" | "decode" | "kv_transfer" | "router" | "colocated"
    instance_id: str  # unique within (namespace, service); stable for the life of the process
    address: str  # host:port of its gRPC server
    metrics_url: str  # e.g. http://10.0.0.5:9100/metrics
    model: str  # the model it serves
    load: Load
    started_at: float  # wall-clock seconds since the epoch (time.time()), for display and age
    draining: bool = False  # finishing in-flight work; takes no new requests
    kv: KVSummary = KVSummary()  # the prefix blocks it holds, for the router's prefix-hit estimate

    def __post_init__(self) -> None:
        check_service(self.service)
        if not self.instance_id:
            raise ConfigError("instance_id must not be empty")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the wire form in Redis)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceInfo:
        """Inverse of `to_dict`; ignores unknown keys so that a newer writer does not break an older
        reader during a rolling upgrade."""
        load_fields = {f.name for f in dataclasses.fields(Load)}
        load = Load(**{k: int(v) for k, v in dict(data.get("load", {})).items() if k in load_fields})
        raw_kv = dict(data.get("kv") or {})
        kv = KVSummary(block_size=int(raw_kv.get("block_size", 0)), hash_salt=str(raw_kv.get("hash_salt", "")),
                       block_hashes=tuple(str(h) for h in raw_kv.get("block_hashes", ())))
        info_fields = {f.name for f in dataclasses.fields(cls)} - {"load", "kv"}
        return cls(load=load, kv=kv, **{k: v for k, v in data.items() if k in info_fields})


class Registry(Protocol):
    """Where instances announce themselves and find each other.

    Semantics both implementations share:
    - `register` creates or replaces the entry and remembers `ttl_s` for later heartbeats.
    - `heartbeat` replaces the entry's info (new load, draining flag) and pushes its expiry back by
      the remembered `ttl_s`. If the entry had lapsed (or the Redis server restarted empty), the
      heartbeat re-creates it: an instance that was forgotten comes back on its next beat. It must
      follow a `register` of the same (service, instance_id) on this registry object.
    - `list` returns the live entries of one service, sorted by instance_id.
    - A backend that cannot be reached raises `UnavailableError`.
    """

    async def register(self, info: InstanceInfo, ttl_s: float) -> None: ...

    async def heartbeat(self, info: InstanceInfo) -> None: ...

    async def deregister(self, service: str, instance_id: str) -> None: ...

    async def list(self, service: str) -> list[InstanceInfo]: ...

    async def close(self) -> None: ...
