"""Hosting an engine as a gRPC service: load, serve, report load, stop cleanly.

    start_engine_service(settings, service, role, add_servicer)
      ├ LLMEngine loaded off the event loop (progress in the log)
      ├ AsyncEngine thread started
      ├ gRPC server (health SERVING) with the service's servicer
      ├ /metrics (Prometheus) on its own port
      └ registry heartbeat (when a Redis URL is set)
    RunningEngineService.stop(): draining in the registry, gRPC drained for the
      grace period, engine stopped (requests left are failed, blocks freed), deregistered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc.aio
import torch

from shared.engine.async_engine import AsyncEngine
from shared.engine.core_share import CoreShare
from shared.engine.engine import LLMEngine
from shared.grpc_common import GrpcServer, make_server
from shared.registry import connect_registry
from shared.registry.base import InstanceInfo, Load, Registry
from shared.registry.heartbeat import Heartbeater
from shared.registry.kv_summary import KVSummary, summarize
from shared.service.engine_metrics import engine_registry
from shared.service.fresh_thread import run_on_fresh_thread
from shared.service.kv_client import KVTransferClient
from shared.service.lifecycle import MetricsHTTP, write_port_file
from shared.service.settings import EngineServiceSettings

logger = logging.getLogger(__name__)

AddServicer = Callable[[AsyncEngine, grpc.aio.Server], None]


@dataclass
class RunningEngineService:
    settings: EngineServiceSettings
    service: str
    aengine: AsyncEngine
    grpc: GrpcServer
    metrics: MetricsHTTP | None
    registry: Registry | None
    heartbeater: Heartbeater | None

    @property
    def address(self) -> str:
        host = self.settings.advertise_host or self.grpc.host
        return f"{host}:{self.grpc.port}"

    def failure(self) -> str | None:
        """Why this service cannot serve any more (its engine thread died), or None."""
        return None if self.aengine.running else "engine thread stopped"

    async def stop(self) -> None:
        logger.info("%s on %s stopping (grace %.1f s)", self.service, self.address, self.settings.shutdown_grace_s)
        if self.heartbeater is not None:
            await self.heartbeater.set_draining(True)
        await self.grpc.stop(self.settings.shutdown_grace_s)
        await asyncio.to_thread(self.aengine.stop)
        if self.heartbeater is not None:
            await self.heartbeater.stop()
        if self.registry is not None:
            await self.registry.close()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)
        logger.info("%s on %s stopped", self.service, self.address)


def _load(aengine: AsyncEngine) -> Load:
    load = aengine.load
    return Load(load.num_running, load.num_waiting, load.num_kv_blocks_total, load.num_kv_blocks_free)


def engine_kv_summary(aengine: AsyncEngine) -> KVSummary:
    """The prefix blocks the engine's cache holds, named as a router hashes a prompt for it."""
    engine = aengine.engine
    return summarize(aengine.load.cached_block_hashes, engine.config.block_size, engine.kv.hash_salt.decode())


async def start_engine_service(
    settings: EngineServiceSettings, service: str, role: str, add_servicer: AddServicer, grpc_service_name: str,
    push_mode: str = "layerwise",
) -> RunningEngineService:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    # before the model load: a registry that cannot be reached fails the start now, with its reason
    registry = await connect_registry(settings.redis_url, settings.registry_namespace) if settings.redis_url else None
    logger.info("%s: loading %s (role %s) ...", service, settings.model, role)
    engine = await run_on_fresh_thread(LLMEngine, settings.engine_config(role))
    # handoffs move through kv_transfer's slots (the transport agents are made on first use)
    engine.enable_remote_kv(push_mode, settings.host, settings.kv_transfer_timeout_s)
    cores = None
    if settings.core_share_file is not None and engine.config.device == "cpu":
        cores = CoreShare(settings.core_share_file, settings.core_share_slot, torch.get_num_threads())
        logger.info("%s: %d torch threads while other engines of this host have work, %d while they have none",
                    service, cores.share_threads, cores.max_threads)
    aengine = AsyncEngine(engine, cores)
    aengine.start()
    server = make_server(settings.address, settings.max_message_bytes)
    add_servicer(aengine, server.server)
    await server.start(grpc_service_name)
    metrics = None
    if settings.metrics_port >= 0:
        metrics = MetricsHTTP(settings.host, settings.metrics_port, engine_registry(aengine, role))
    running = RunningEngineService(settings, service, aengine, server, metrics, registry, None)
    if running.registry is not None:
        info = InstanceInfo(
            service=service, instance_id=settings.resolved_instance_id(service), address=running.address,
            metrics_url=metrics.url if metrics else "", model=settings.model, load=_load(aengine),
            started_at=time.time(),
        )
        running.heartbeater = Heartbeater(running.registry, info, lambda: _load(aengine), settings.heartbeat_ttl_s,
                                          kv_fn=lambda: engine_kv_summary(aengine))
        await running.heartbeater.start()
    write_port_file(settings.port_file, server.port)
    logger.info("%s ready on %s (metrics %s)", service, running.address, metrics.url if metrics else "off")
    return running


@dataclass
class RunningKVService:
    """An engine service plus its kv_transfer client (prefill pushes, decode claims)."""

    host: RunningEngineService
    kv: KVTransferClient

    @property
    def address(self) -> str:
        return self.host.address

    def failure(self) -> str | None:
        return self.host.failure()

    async def stop(self) -> None:
        await self.host.stop()
        await self.kv.close()
