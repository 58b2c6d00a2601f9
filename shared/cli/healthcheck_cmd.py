"""`baton healthcheck [SERVICE]`: is the service in this container serving? (the image's HEALTHCHECK)

    SERVICE (default: the one PID 1 runs, from /proc/1/cmdline: `baton decode` -> decode)
      router                   GET http://<host>:<port>/health        200 = healthy
      prefill|decode|kv-transfer   grpc.health.v1 Check on <host>:<port>   SERVING = healthy
    port: the service's own setting (its environment, as the service read it); when that is 0 (an
    OS-picked port, as with host networking and several replicas) the port the service wrote to its
    `port_file`. Exit 0 healthy, 1 not (the reason on stderr), as Docker's and podman's checks expect.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path

SERVICES = ("router", "prefill", "decode", "kv-transfer")
TIMEOUT_S = 3.0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("healthcheck", help="exit 0 when the service in this container serves (HEALTHCHECK)")
    p.add_argument("service", nargs="?", choices=SERVICES, help="default: the service PID 1 runs")
    p.set_defaults(func=run_healthcheck)


def service_of_pid1(cmdline_path: Path = Path("/proc/1/cmdline")) -> str | None:
    """The baton service PID 1 runs (`.../baton decode` -> "decode"), or None."""
    try:
        argv = cmdline_path.read_bytes().split(b"\0")
    except OSError:
        return None
    words = [w.decode(errors="replace") for w in argv if w]
    return next((w for w in words if w in SERVICES), None)


def _probe_host(bind_host: str) -> str:
    """Where to reach a server bound to `bind_host` from inside its container."""
    return "127.0.0.1" if bind_host in ("", "0.0.0.0") else ("::1" if bind_host == "::" else bind_host)


def _port(configured: int, port_file: Path | None) -> int:
    if configured:
        return configured
    if port_file is None:
        raise RuntimeError("port is 0 and no port_file is set: nothing says which port the service bound")
    try:
        return int(port_file.read_text().strip())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"not serving yet: no port in {port_file} ({exc})") from exc


def check_grpc(host: str, port: int) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")


def check_http(host: str, port: int) -> None:
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with urllib.request.urlopen(f"http://{netloc}/health", timeout=TIMEOUT_S) as response:  # noqa: S310
        if response.status != 200:
            raise RuntimeError(f"{netloc}/health: HTTP {response.status}")


def check(service: str) -> None:
    """Raise with the reason unless `service`, configured by this environment, is serving."""
    if service == "router":
        from services.router.settings import RouterSettings

        router = RouterSettings()
        check_http(_probe_host(router.host), router.port)
        return
    from services.decode.settings import DecodeSettings
    from services.kv_transfer.settings import KVTransferSettings
    from services.prefill.settings import PrefillSettings

    classes = {"prefill": PrefillSettings, "decode": DecodeSettings, "kv-transfer": KVTransferSettings}
    settings = classes[service]()
    check_grpc(_probe_host(settings.host), _port(settings.port, settings.port_file))


def run_healthcheck(args: argparse.Namespace) -> int:
    service = args.service or service_of_pid1()
    if service is None:
        print("baton healthcheck: PID 1 runs no baton service; name one", file=sys.stderr)
        return 1
    try:
        check(service)
    except Exception as exc:  # any failure is "unhealthy", with its reason for `podman inspect`
        print(f"baton healthcheck: {service} unhealthy: {exc}", file=sys.stderr)
        return 1
    return 0
