"""Entry point of the prefill service (`baton prefill`): settings from `BATON_PREFILL_*`."""

from __future__ import annotations

import grpc.aio

from proto.baton.v1 import prefill_pb2_grpc
from services.prefill.server import SERVICE_NAME, PrefillServicer
from services.prefill.settings import PrefillSettings
from shared.engine.async_engine import AsyncEngine
from shared.service.engine_host import RunningKVService, start_engine_service
from shared.service.gc_heap import frozen_after
from shared.service.kv_client import KVTransferClient
from shared.service.lifecycle import run, run_until_signal, set_up_process


async def start(settings: PrefillSettings) -> RunningKVService:
    kv = KVTransferClient(settings.max_message_bytes)

    def add(aengine: AsyncEngine, server: grpc.aio.Server) -> None:
        servicer = PrefillServicer(aengine, kv, settings.kv_hidden_states, settings.share_encoder_outputs)
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)

    host = await start_engine_service(settings, "prefill", "prefill", add, SERVICE_NAME, settings.kv_push_mode)
    return RunningKVService(host, kv)


def main() -> None:
    settings = PrefillSettings()
    set_up_process("prefill", settings)
    run(run_until_signal(lambda: frozen_after(start(settings))))


if __name__ == "__main__":
    main()
