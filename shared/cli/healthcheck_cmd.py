"""`baton healthcheck [SERVICE]`: is the service in this container serving? (the image's HEALTHCHECK)

`python -m shared.cli.healthcheck_cmd [SERVICE]` is the same without the rest of the CLI: it imports
neither torch nor the models (0.3 s against 3 s; a check has 5 s), so it reads the few settings it
needs through a probe's own settings classes, which share the services' prefixes and defaults
(tests/unit/cli/test_healthcheck.py holds them equal).

    SERVICE (default: the one PID 1 runs, from /proc/1/cmdline: `baton decode` -> decode)
      router                   GET http://<host>:<port>/health        200 = healthy
      prefill|decode|kv-transfer|encoder   grpc.health.v1 Check on <host>:<port>   SERVING = healthy
    port: the service's own setting (its environment, as the service read it); when that is 0 (an
    OS-picked port, as with host networking and several replicas) the port the service wrote to its
    `port_file`. Exit 0 healthy, 1 not (the reason on stderr), as Docker's and podman's checks expect.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

SERVICES = ("router", "prefill", "decode", "kv-transfer", "encoder")
TIMEOUT_S = 3.0


class ProbeSettings(BaseSettings):
    """Where a service listens, as its own settings read it (only these fields, no torch import)."""

    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = 0
    port_file: Path | None = None
    tls_dir: Path | None = None  # mutual TLS: the check presents the service's own certificate


class RouterProbe(ProbeSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_ROUTER_")
    port: int = 8000


class PrefillProbe(ProbeSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_PREFILL_")
    port: int = 50051


class DecodeProbe(ProbeSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_DECODE_")
    port: int = 50052


class KVTransferProbe(ProbeSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_KV_TRANSFER_")
    port: int = 50053


class EncoderProbe(ProbeSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_ENCODER_")
    port: int = 50054


PROBES: dict[str, type[ProbeSettings]] = {"router": RouterProbe, "prefill": PrefillProbe, "decode": DecodeProbe,
                                          "kv-transfer": KVTransferProbe, "encoder": EncoderProbe}


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


def check_grpc(host: str, port: int, tls_dir: Path | None = None, service: str = "") -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls_dir is None:
        channel = grpc.insecure_channel(target)
    else:  # the same files and target name as the service's own channels (shared/grpc_tls.py)
        from shared.grpc_tls import channel_credentials, load_tls, target_name_options
        tls = load_tls(tls_dir, service)
        channel = grpc.secure_channel(target, channel_credentials(tls), options=target_name_options())
    with channel:
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
    settings = PROBES[service]()
    host = _probe_host(settings.host)
    if service == "router":
        check_http(host, settings.port)
    else:
        check_grpc(host, _port(settings.port, settings.port_file), settings.tls_dir, service.replace("-", "_"))


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.cli.healthcheck_cmd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("service", nargs="?", choices=SERVICES, help="default: the service PID 1 runs")
    return run_healthcheck(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
