"""`baton healthcheck`: the image's HEALTHCHECK, against real servers on loopback."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.decode.settings import DecodeSettings
from services.encoder.settings import EncoderSettings
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.settings import PrefillSettings
from services.router.settings import RouterSettings
from shared.cli.healthcheck_cmd import PROBES, check, run_healthcheck, service_of_pid1
from shared.grpc_common import GrpcServer, make_server
from shared.service.lifecycle import write_port_file


def test_the_service_is_read_from_pid_1s_command_line(tmp_path: Path) -> None:
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"/opt/baton/venv/bin/python\0/opt/baton/app/bin/baton\0kv-transfer\0")
    assert service_of_pid1(cmdline) == "kv-transfer"
    cmdline.write_bytes(b"/bin/sh\0-c\0sleep 1\0")
    assert service_of_pid1(cmdline) is None
    assert service_of_pid1(tmp_path / "missing") is None


@pytest.mark.parametrize(("service", "settings_cls"), [("router", RouterSettings), ("prefill", PrefillSettings),
                                                      ("decode", DecodeSettings), ("kv-transfer", KVTransferSettings),
                                                      ("encoder", EncoderSettings)])
def test_the_probes_read_what_the_services_read(service: str, settings_cls: type, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    probe_cls = PROBES[service]
    prefix = probe_cls.model_config["env_prefix"]
    assert settings_cls.model_config["env_prefix"] == prefix
    for name in ("host", "port"):
        assert probe_cls.model_fields[name].default == settings_cls.model_fields[name].default, name
    if service != "router":
        assert "port_file" in settings_cls.model_fields
    monkeypatch.setenv(f"{prefix}HOST", "0.0.0.0")
    monkeypatch.setenv(f"{prefix}PORT", "1234")
    probe = probe_cls()
    assert (probe.host, probe.port) == ("0.0.0.0", 1234)


@pytest.fixture
def grpc_server() -> Iterator[GrpcServer]:
    """A gRPC server with the health service (as every baton engine has) on an OS-picked port."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, GrpcServer] = {}
    stop = asyncio.Event()

    async def serve() -> None:
        server = make_server("127.0.0.1:0")
        await server.start("baton.v1.DecodeService")
        holder["server"] = server
        ready.set()
        await stop.wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield holder["server"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    loop.close()


def test_an_os_picked_port_is_found_through_the_port_file(grpc_server: GrpcServer, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    port_file = tmp_path / "port"
    monkeypatch.setenv("BATON_DECODE_HOST", "127.0.0.1")
    monkeypatch.setenv("BATON_DECODE_PORT", "0")
    monkeypatch.setenv("BATON_DECODE_PORT_FILE", str(port_file))
    with pytest.raises(RuntimeError, match="not serving yet"):
        check("decode")  # no port written yet
    write_port_file(port_file, grpc_server.port)
    check("decode")
    assert run_healthcheck(argparse.Namespace(service="decode")) == 0


def test_nothing_listening_is_unhealthy_with_the_reason(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_KV_TRANSFER_PORT", "1")
    assert run_healthcheck(argparse.Namespace(service="kv-transfer")) == 1
    assert "kv-transfer unhealthy" in capsys.readouterr().err
    monkeypatch.setenv("BATON_ROUTER_PORT", "1")
    assert run_healthcheck(argparse.Namespace(service="router")) == 1
    assert "router unhealthy" in capsys.readouterr().err
