"""Entry point of the decode service (`baton decode`): settings from `BATON_DECODE_*`."""

from __future__ import annotations

import asyncio
import logging

import grpc.aio

from proto.baton.v1 import decode_pb2_grpc
from services.decode.server import SERVICE_NAME, DecodeServicer
from services.decode.settings import DecodeSettings
from shared.engine.async_engine import AsyncEngine
from shared.grpc_tls import configure_internal_auth
from shared.service.engine_host import RunningKVService, start_engine_service
from shared.service.kv_client import KVTransferClient
from shared.service.lifecycle import run_until_signal
from shared.telemetry import setup_tracing


async def start(settings: DecodeSettings) -> RunningKVService:
    kv = KVTransferClient(settings.max_message_bytes)

    def add(aengine: AsyncEngine, server: grpc.aio.Server) -> None:
        servicer = DecodeServicer(aengine, kv, settings.kv_claim_wait_s)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)

    service = "colocated" if settings.role == "colocated" else "decode"
    host = await start_engine_service(settings, service, settings.role, add, SERVICE_NAME)
    return RunningKVService(host, kv)


def main() -> None:
    settings = DecodeSettings()
    configure_internal_auth(settings.internal_token, settings.tls_dir, "decode")  # colocated role too
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("baton-decode")
    asyncio.run(run_until_signal(lambda: start(settings)))


if __name__ == "__main__":
    main()
