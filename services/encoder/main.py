"""Entry point of the encoder service (`baton encoder`): settings from `BATON_ENCODER_*`.

    start(settings)
      ├ the checkpoint's media towers and processor only (no text model), in the prefill engines' dtype
      ├ batcher worker, gRPC server (health SERVING), /metrics
      └ registry heartbeat as service "encoder" (load: items queued or in a pass)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from proto.baton.v1 import encoder_pb2_grpc
from services.encoder.batcher import EncodeBatcher
from services.encoder.server import SERVICE_NAME, EncoderMetrics, EncoderServicer
from services.encoder.settings import EncoderSettings
from shared.engine.precision import resolve_precision
from shared.errors import ConfigError
from shared.grpc_auth import AuthCollector
from shared.grpc_common import GrpcServer, make_server
from shared.models.families import spec_from_config
from shared.models.loader import model_identity, read_config, resolve_model
from shared.multimodal.encoder import MediaEncoder
from shared.multimodal.loading import load_media_encoder
from shared.registry import connect_registry
from shared.registry.base import InstanceInfo, Load, Registry
from shared.registry.heartbeat import Heartbeater
from shared.service.fresh_thread import run_on_fresh_thread
from shared.service.kv_client import KVTransferClient
from shared.service.lifecycle import MetricsHTTP, run, run_until_signal, set_up_process, write_port_file
from shared.wire_encoder import encoder_outputs_key

logger = logging.getLogger(__name__)


@dataclass
class RunningEncoder:
    settings: EncoderSettings
    grpc: GrpcServer
    encoder: MediaEncoder
    batcher: EncodeBatcher
    kv: KVTransferClient
    metrics: EncoderMetrics
    metrics_http: MetricsHTTP | None
    registry: Registry | None = None
    heartbeater: Heartbeater | None = None

    @property
    def address(self) -> str:
        return f"{self.settings.advertise_host or self.grpc.host}:{self.grpc.port}"

    async def stop(self) -> None:
        if self.heartbeater is not None:
            await self.heartbeater.set_draining(True)
        await self.grpc.stop(self.settings.shutdown_grace_s)
        await self.batcher.stop()
        await self.kv.close()
        if self.heartbeater is not None:
            await self.heartbeater.stop()
        if self.registry is not None:
            await self.registry.close()
        if self.metrics_http is not None:
            await asyncio.to_thread(self.metrics_http.stop)
        logger.info("encoder on %s stopped", self.address)


def load_towers(settings: EncoderSettings) -> tuple[MediaEncoder, str]:
    """The checkpoint's media path and the key its outputs go under in kv_transfer (the model's identity and
    the towers' dtype, as its prefill engines name them)."""
    hf_dir = resolve_model(settings.model, settings.cache_dir)
    arch_name, _, config = read_config(hf_dir)
    dtype = resolve_precision(settings.dtype, "auto", settings.device).compute
    found = load_media_encoder(hf_dir, arch_name, settings.device, dtype, settings.cache_items,
                               settings.cuda_graphs)
    if found is None:
        raise ConfigError(f"{settings.model} reads no images or audio: it has nothing for an encoder service")
    return found[0], encoder_outputs_key(model_identity(spec_from_config(config)), dtype)


async def start(settings: EncoderSettings) -> RunningEncoder:
    registry = await connect_registry(settings.redis_url, settings.registry_namespace) if settings.redis_url else None
    logger.info("encoder: loading the media towers of %s ...", settings.model)
    encoder, model_key = await run_on_fresh_thread(load_towers, settings)
    metrics = EncoderMetrics(CollectorRegistry())
    metrics.registry.register(AuthCollector())
    batcher = EncodeBatcher(encoder.encode_batch, settings.max_batch_items, metrics.on_batch)
    batcher.start()
    metrics.watch(batcher)
    kv = KVTransferClient(settings.max_message_bytes)
    server = make_server(settings.address, settings.max_message_bytes)
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(
        EncoderServicer(encoder, batcher, kv, model_key, metrics), server.server)
    await server.start(SERVICE_NAME)
    metrics_http = MetricsHTTP(settings.host, settings.metrics_port, metrics.registry) \
        if settings.metrics_port >= 0 else None
    running = RunningEncoder(settings, server, encoder, batcher, kv, metrics, metrics_http, registry)
    if registry is not None:
        def load() -> Load:
            return Load(num_running=batcher.num_queued)

        info = InstanceInfo(service="encoder", instance_id=settings.resolved_instance_id("encoder"),
                            address=running.address, metrics_url=metrics_http.url if metrics_http else "",
                            model=settings.model, load=load(), started_at=time.time())
        running.heartbeater = Heartbeater(registry, info, load, settings.heartbeat_ttl_s)
        await running.heartbeater.start()
    write_port_file(settings.port_file, server.port)
    logger.info("encoder ready on %s (outputs as %s; metrics %s)", running.address, model_key,
                metrics_http.url if metrics_http else "off")
    return running


def main() -> None:
    settings = EncoderSettings()
    set_up_process("encoder", settings)
    run(run_until_signal(lambda: start(settings)))


if __name__ == "__main__":
    main()
