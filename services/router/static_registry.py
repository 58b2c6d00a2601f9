"""An in-process registry for single-host stacks without Redis (`baton up` default).

The launcher tells the router every service address up front; this poller asks
each one for its health, load and the prefix blocks it holds every `interval_s` and (re-)registers the
live ones in a `MemoryRegistry` with a TTL, so a dead instance is forgotten
exactly as a lapsed Redis heartbeat would be.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from proto.baton.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    encoder_pb2,
    encoder_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from shared.errors import ConfigError
from shared.grpc_common import channel, check_health
from shared.registry.base import InstanceInfo, Load
from shared.registry.kv_summary import KVSummary
from shared.registry.memory_registry import MemoryRegistry
from shared.service.lifecycle import cancel, every
from shared.wire import kv_summary_from_proto, load_from_proto

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaticTarget:
    service: str  # prefill | decode | colocated | kv_transfer | encoder
    address: str


def parse_targets(spec: str) -> list[StaticTarget]:
    """'prefill=127.0.0.1:5001,decode=127.0.0.1:5002,...' -> targets."""
    targets = []
    for item in filter(None, (p.strip() for p in spec.split(","))):
        service, sep, address = item.partition("=")
        if not sep or not address:
            raise ConfigError(f"static instance must be service=host:port, got {item!r}")
        targets.append(StaticTarget(service.strip(), address.strip()))
    return targets


class StaticRegistryPoller:
    def __init__(self, targets: list[StaticTarget], interval_s: float = 1.0, ttl_s: float = 3.0) -> None:
        self.registry = MemoryRegistry()
        self.targets = targets
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._started_at = time.time()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.poll_once()
        self._task = every(self.interval_s, self.poll_once, "static-registry")

    async def stop(self) -> None:
        await cancel(self._task)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(t) for t in self.targets))

    async def _poll(self, target: StaticTarget) -> None:
        try:
            reported = await self._load(target)
        except (TimeoutError, grpc.RpcError, OSError) as e:
            logger.debug("%s at %s not answering: %s", target.service, target.address, e)
            return
        if reported is None:
            return
        load, kv = reported
        info = InstanceInfo(service=target.service, instance_id=f"{target.service}@{target.address}",
                            address=target.address, metrics_url="", model="", load=load,
                            started_at=self._started_at, kv=kv)
        await self.registry.register(info, self.ttl_s)

    async def _load(self, target: StaticTarget) -> tuple[Load, KVSummary] | None:
        """(its load, the prefix blocks it holds), or None while it is not serving."""
        if target.service == "kv_transfer":
            if not await check_health(target.address, timeout_s=1.0):
                return None
            async with channel(target.address) as ch:
                stats = await kv_transfer_pb2_grpc.KVTransferServiceStub(ch).Stats(kv_transfer_pb2.StatsRequest(),
                                                                                     timeout=1.0)
            return Load(num_running=stats.active_leases), kv_summary_from_proto(stats.kv)
        async with channel(target.address) as ch:
            if target.service == "encoder":
                report = await encoder_pb2_grpc.EncoderServiceStub(ch).GetLoad(encoder_pb2.EncoderLoadRequest(),
                                                                                timeout=1.0)
            elif target.service == "prefill":
                report = await prefill_pb2_grpc.PrefillServiceStub(ch).GetLoad(prefill_pb2.LoadRequest(), timeout=1.0)
            else:
                report = await decode_pb2_grpc.DecodeServiceStub(ch).GetLoad(decode_pb2.DecodeLoadRequest(),
                                                                              timeout=1.0)
        return load_from_proto(report), kv_summary_from_proto(report.kv)
