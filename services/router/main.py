"""Entry point of the router (`baton router`): settings from `BATON_ROUTER_*`.

    tokenizer (no weights) + registry (Redis, or an in-process one polling the
    addresses `baton up` gave) ─► InstanceCache ─► GrpcBackend ─► FastAPI app ─► uvicorn
uvicorn owns SIGTERM/SIGINT: it stops accepting, lets requests in flight finish
(up to the grace period), then the backend and registry are closed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Any

import uvicorn

from services.router.app import create_app
from services.router.grpc_backend import GrpcBackend
from services.router.instance_cache import InstanceCache
from services.router.media import RouterMedia
from services.router.migration import MigrationPolicy
from services.router.routing import Router
from services.router.settings import RouterSettings
from services.router.static_registry import StaticRegistryPoller, parse_targets
from shared.errors import ConfigError
from shared.models.generation_config import load_generation_defaults
from shared.models.loader import resolve_model
from shared.registry import connect_registry
from shared.registry.base import Registry
from shared.service.gc_heap import freeze_startup_heap
from shared.service.lifecycle import run, set_up_process

logger = logging.getLogger(__name__)


@dataclass
class RouterParts:
    app: Any
    backend: GrpcBackend
    cache: InstanceCache
    registry: Registry
    poller: StaticRegistryPoller | None

    async def stop(self) -> None:
        await self.app.state.router.close()
        await self.cache.stop()
        if self.poller is not None:
            await self.poller.stop()
        await self.backend.close()
        await self.registry.close()


async def build(settings: RouterSettings) -> RouterParts:
    from transformers import AutoTokenizer

    hf_dir = await asyncio.to_thread(resolve_model, settings.model, settings.cache_dir)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, hf_dir)
    defaults = load_generation_defaults(settings.generation_config, settings.model, hf_dir)
    poller = None
    if settings.redis_url:
        registry: Registry = await connect_registry(settings.redis_url, settings.registry_namespace)
    elif settings.static_instances:
        poller = StaticRegistryPoller(parse_targets(settings.static_instances))
        await poller.start()
        registry = poller.registry
    else:
        raise ConfigError("the router needs BATON_ROUTER_REDIS_URL or BATON_ROUTER_STATIC_INSTANCES")
    cache = InstanceCache(registry)
    await cache.start()
    router = Router(settings.routing_policy, local_prefill_max_tokens=settings.local_prefill_max_tokens,
                    routed_prefix_ttl_s=settings.routed_prefix_ttl_s)
    migration = MigrationPolicy(settings.migration_limit, settings.decode_stall_timeout_s, settings.migration_wait_s)
    backend = GrpcBackend(cache, settings.mode, router=router, migration=migration)
    media = await asyncio.to_thread(RouterMedia.from_checkpoint, hf_dir, settings)
    app = create_app(settings, backend, tokenizer, settings.model_name, defaults, media)
    return RouterParts(app, backend, cache, registry, poller)


async def serve(settings: RouterSettings) -> None:
    parts = await build(settings)
    config = uvicorn.Config(parts.app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s), access_log=False)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler that was there
    # before it; a no-op one lets control come back here so the backend and registry close cleanly
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        logger.info("router serving %s on http://%s:%d (mode %s)", settings.model_name, settings.host,
                    settings.port, settings.mode)
        freeze_startup_heap()  # the app, tokenizer and backend are built: collections skip them from here
        await uvicorn.Server(config).serve()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        await parts.stop()
        logger.info("router stopped")


def main() -> None:
    settings = RouterSettings()
    set_up_process("router", settings)
    run(serve(settings))


if __name__ == "__main__":
    main()
