"""Entry point of the decode service (`baton decode`): settings from `BATON_DECODE_*`."""

from __future__ import annotations

import asyncio

import grpc.aio

from proto.baton.v1 import decode_pb2_grpc
from services.decode.server import SERVICE_NAME, DecodeServicer
from services.decode.settings import DecodeSettings
from shared.engine.async_engine import AsyncEngine
from shared.service.engine_host import RunningKVService, start_engine_service
from shared.service.gc_heap import frozen_after
from shared.service.kv_calls import EngineKVCalls
from shared.service.kv_client import KVTransferClient
from shared.service.lifecycle import run, run_until_signal, set_up_process


async def start(settings: DecodeSettings) -> RunningKVService:
    kv = KVTransferClient(settings.max_message_bytes)

    def add(aengine: AsyncEngine, server: grpc.aio.Server) -> None:
        calls = None
        if settings.kv_spill and settings.role == "decode":  # a colocated instance's KV never came through one
            calls = EngineKVCalls(kv, asyncio.get_running_loop(), settings.kv_spill_call_timeout_s)
            aengine.engine.enable_kv_spill(calls)  # before any request: the engine thread reads it
        servicer = DecodeServicer(aengine, kv, settings.kv_claim_wait_s, calls)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)

    service = "colocated" if settings.role == "colocated" else "decode"
    host = await start_engine_service(settings, service, settings.role, add, SERVICE_NAME)
    return RunningKVService(host, kv)


def main() -> None:
    settings = DecodeSettings()
    set_up_process("decode", settings)  # colocated role too
    run(run_until_signal(lambda: frozen_after(start(settings))))


if __name__ == "__main__":
    main()
