"""Entry point of the kv_transfer service: `python -m services.kv_transfer.main`.

Settings come from `BATON_KV_TRANSFER_*` (see `settings.py`), parsed once in
`main()`. `start(settings)` builds and starts one instance (tests start
several in one process); `serve(settings)` runs one until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from proto.baton.v1 import kv_transfer_pb2_grpc
from services.kv_transfer.encoder_cache import EncoderOutputCache
from services.kv_transfer.server import (
    SERVICE_NAME,
    KVTransferMetrics,
    KVTransferServicer,
    pool_summary,
    slab_space,
)
from services.kv_transfer.settings import KVTransferSettings
from services.kv_transfer.slots import make_policy
from services.kv_transfer.store import HandoffStore
from shared.grpc_auth import AuthCollector
from shared.grpc_common import GrpcServer, make_server
from shared.kv.remote import AgentAddress, SlotSpace
from shared.registry import connect_registry
from shared.registry.base import InstanceInfo, Load, Registry
from shared.registry.heartbeat import Heartbeater
from shared.service.lifecycle import (
    MetricsHTTP,
    cancel,
    every,
    run,
    run_until_signal,
    set_up_process,
    write_port_file,
)
from shared.transport import Transport
from shared.transport.factory import service_transport
from shared.transport.memory import host_buffer
from shared.transport.prefault import Prefaulter

logger = logging.getLogger(__name__)


@dataclass
class RunningKVTransfer:
    """One started kv_transfer instance and everything it owns."""

    settings: KVTransferSettings
    grpc: GrpcServer
    store: HandoffStore
    metrics: KVTransferMetrics
    sweeper: asyncio.Task[None]
    metrics_http: MetricsHTTP | None
    transport: Transport
    encoder_cache: EncoderOutputCache
    prefaulter: Prefaulter
    heartbeater: Heartbeater | None = None
    registry: Registry | None = None

    @property
    def address(self) -> str:
        return self.grpc.address

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_http.port if self.metrics_http else None

    async def stop(self) -> None:
        """Stop taking calls, drain for the grace period, then drop every lease still held."""
        # the metrics server notices a shutdown only at its next poll (0.5 s): overlap that wait
        metrics = self.metrics_http
        metrics_stopped = asyncio.create_task(asyncio.to_thread(metrics.stop if metrics else lambda: None))
        if self.heartbeater is not None:
            await self.heartbeater.set_draining(True)
        await self.grpc.stop(self.settings.shutdown_grace_s)
        await cancel(self.sweeper)
        dropped = self.store.release_all()
        # after the gRPC server: no Reserve can hand out a slot any more; peers mid-transfer fail
        await asyncio.to_thread(self.prefaulter.close)  # its thread touches the slab: stopped before it goes
        await asyncio.to_thread(self.transport.close)
        if self.heartbeater is not None:
            await self.heartbeater.stop()
        if self.registry is not None:
            await self.registry.close()
        await metrics_stopped
        logger.info("kv_transfer on %s stopped (%d leases dropped)", self.address, dropped)


async def start(settings: KVTransferSettings) -> RunningKVTransfer:
    """Build the slab and its agent, the store, servicer, gRPC server (with health) and metrics; start them."""
    # first: a registry that cannot be reached fails the start now, with its reason
    registry = await connect_registry(settings.redis_url, settings.registry_namespace) if settings.redis_url else None
    agent_name = f"kv_transfer-{uuid.uuid4().hex[:12]}"
    transport, address = await asyncio.to_thread(_make_slab, settings, agent_name)
    metrics = KVTransferMetrics(CollectorRegistry())
    metrics.registry.register(AuthCollector())
    store = HandoffStore(
        settings.capacity_bytes, slab_space(agent_name, address.space.base_addr, settings.slot_nbytes,
                                            settings.capacity_bytes),
        lease_timeout_s=settings.lease_timeout_s, claim_timeout_s=settings.claim_timeout_s,
        max_lease_timeout_s=settings.max_lease_timeout_s, on_end=metrics.on_lease_end,
        policy=make_policy(settings.eviction_policy),
    )
    if store.space is not None:
        address = AgentAddress(address.kind, address.metadata, store.space)
    metrics.watch(store)
    transport.watch_traffic(store.data_moving)  # full-rate progress while a handoff is written or read
    server = make_server(settings.address, settings.max_message_bytes)
    encoder_cache = EncoderOutputCache(settings.encoder_cache_bytes)
    # the slab's pages faulted in ahead of the slots handed out (idle priority), not in a prefill's first write
    prefaulter = Prefaulter(address.space.base_addr, settings.capacity_bytes, settings.prefault_ahead_bytes,
                            f"prefault-{agent_name}")
    servicer = KVTransferServicer(store, metrics, address, settings.capacity_bytes, settings.max_claim_wait_s,
                                  encoder_cache, transport.expect_traffic, prefaulter.used_up_to)
    kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server(servicer, server.server)
    try:
        await server.start(SERVICE_NAME)
        metrics_http = None
        if settings.metrics_port >= 0:
            metrics_http = MetricsHTTP(settings.host, settings.metrics_port, metrics.registry)
    except BaseException:
        await server.stop(0)
        prefaulter.close()
        transport.close()
        raise
    sweeper = every(settings.sweep_interval_s, store.sweep, "kv_transfer-sweeper")
    running = RunningKVTransfer(settings, server, store, metrics, sweeper, metrics_http, transport, encoder_cache,
                                prefaulter)
    if registry is not None:
        running.registry = registry
        running.heartbeater = await _register(settings, running, registry)
    write_port_file(settings.port_file, server.port)
    logger.info(
        "kv_transfer listening on %s (%s transport, slab %d bytes, lease timeout %.1fs, metrics %s)",
        running.address, address.kind, settings.capacity_bytes, settings.lease_timeout_s,
        f"http://{settings.host}:{running.metrics_port}/metrics" if metrics_http else "off",
    )
    return running


def _make_slab(settings: KVTransferSettings, agent_name: str) -> tuple[Transport, AgentAddress]:
    """The transport agent and the slab it registers (huge pages, faulted in as slots fill)."""
    transport = service_transport(settings.transport, agent_name, host=settings.host,
                                  advertise_host=settings.advertise_host)
    try:
        slab = host_buffer(max(settings.capacity_bytes, 1), prefault=False)
        region = transport.register(slab)
        metadata = transport.metadata()
    except BaseException:
        transport.close()
        raise
    return transport, AgentAddress(transport.kind, metadata, SlotSpace(agent_name, region.addr, 0, 0,
                                                                       region.device_id))


async def _register(settings: KVTransferSettings, running: RunningKVTransfer, registry: Registry) -> Heartbeater:
    """Announce this instance in the registry; its load is the number of active leases."""
    host = settings.advertise_host or running.grpc.host
    metrics_url = f"http://{host}:{running.metrics_port}/metrics" if running.metrics_port else ""

    def load() -> Load:
        return Load(num_running=running.store.active_leases)

    info = InstanceInfo(
        service="kv_transfer",
        instance_id=settings.instance_id or f"kv_transfer-{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
        address=f"{host}:{running.grpc.port}", metrics_url=metrics_url, model="", load=load(),
        started_at=time.time(),
    )
    heartbeater = Heartbeater(registry, info, load, settings.heartbeat_ttl_s,
                              kv_fn=lambda: pool_summary(running.store))
    await heartbeater.start()
    return heartbeater


async def serve(settings: KVTransferSettings, stop: asyncio.Event | None = None) -> None:
    """Run one instance until `stop` is set or the process gets SIGTERM/SIGINT."""
    await run_until_signal(lambda: start(settings), stop)


def main() -> None:
    settings = KVTransferSettings()
    set_up_process("kv_transfer", settings)
    run(serve(settings))


if __name__ == "__main__":
    main()
