"""gRPC plumbing every baton service shares: servers, channels, health.

A server made here has the error interceptor (`shared.grpc_errors`), the internal
token check (`shared.grpc_auth`) and grpcio's health service installed, and message
limits raised for KV data::

    handle = make_server("127.0.0.1:0")          # port 0: the OS picks one
    add_FooServicer_to_server(FooServicer(...), handle.server)
    await handle.start("baton.v1.FooService")    # health: SERVING
    ...
    await handle.stop(grace_s=5.0)               # health: NOT_SERVING, then drain
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.errors import ConfigError
from shared.grpc_auth import TokenAuthInterceptor, client_interceptors
from shared.grpc_errors import ErrorInterceptor
from shared.grpc_tls import (
    PeerCertInterceptor,
    channel_credentials,
    server_credentials,
    target_name_options,
    tls_files,
)

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # one layer of KV for a long prompt fits
# A channel whose peer went away retries the connection after a backoff that grows to 120 s by default, and
# every call before the next try fails at once ("failed to connect"), even once a supervisor has restarted
# the instance on the same address (seconds later). Our peers are services on the same network: a try a
# second at most reaches a restarted one within a second.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A peer that stops (SIGSTOP, a hung host, a partition) closes nothing: a call waiting on it (a Prefill, a
# Claim) would wait forever. While a call is open a channel pings its peer every keepalive_s, and a ping
# unanswered for as long closes the transport: the calls fail UNAVAILABLE, which callers retry elsewhere.
# HTTP/2 pings are answered by gRPC's own threads, so a peer busy computing still answers.
PEER_KEEPALIVE_S = 10.0
MIN_KEEPALIVE_S = 1.0


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """A channel's keepalive pings: every `keepalive_s` (at least MIN_KEEPALIVE_S) while a call is open."""
    ms = int(max(keepalive_s, MIN_KEEPALIVE_S) * 1000)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),  # grpcio 1.85 waits for a ping's ack this long (default 60 s)
        ("grpc.http2.max_pings_without_data", 0),  # a long unary call sends no data: keep pinging through it
    ]


# Servers take pings at any rate: besides the keepalive timer a channel pings to size its flow-control window
# and on new calls, and a server that counts those as abuse closes the transport (GOAWAY "too many pings"),
# failing every call on it. Our callers are our own services, authenticated.
SERVER_PING_OPTIONS = [("grpc.http2.min_recv_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 1000)),
                       ("grpc.http2.max_ping_strikes", 0)]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options raising gRPC's 4 MiB default message limits, for servers and channels alike."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


@dataclass
class GrpcServer:
    """A grpc.aio server bound to a port, with its health servicer."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    host: str
    port: int  # the port actually bound (the one the OS picked when asked for 0)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def start(self, *service_names: str) -> None:
        """Start serving and report SERVING for the server and each named service."""
        await self.server.start()
        for name in ("", *service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Report NOT_SERVING, then let calls in flight finish for up to `grace_s`."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def make_server(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> GrpcServer:
    """A grpc.aio server listening on `address` (mutual TLS when grpc_tls.set_tls configured it, else
    plaintext), health service registered, not started.

    The error interceptor runs outermost, so exceptions from later interceptors
    are mapped too. Port 0 binds an ephemeral port; `GrpcServer.port` has it.
    """
    host, _ = split_address(address)
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(), TokenAuthInterceptor(), PeerCertInterceptor(), *interceptors],
        options=[*channel_options(max_message_bytes), *SERVER_PING_OPTIONS],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        tls = tls_files()
        port = server.add_secure_port(address, server_credentials(tls)) if tls else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises when the port is taken
        raise ConfigError(f"cannot bind gRPC server to {address}: {exc}") from exc
    if port == 0:
        raise ConfigError(f"cannot bind gRPC server to {address}")
    return GrpcServer(server=server, health=health_servicer, host=host, port=port)


def channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *,
            token_interceptor: bool = True, keepalive_s: float = PEER_KEEPALIVE_S) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` with the same message limits as the servers, sending the process's
    internal token (shared/grpc_auth.py) on every call, over mutual TLS when configured (grpc_tls.py).

    `token_interceptor=False`: no interceptor adds the token; the caller puts `token_metadata()` in every
    call's metadata itself. The router's backend does, for its token streams: grpc.aio reads an
    intercepted stream's messages through an extra async iterator, and that is per token.

    `keepalive_s`: a peer that answers no ping for about this long while a call is open is dead (the call
    fails UNAVAILABLE); see PEER_KEEPALIVE_S."""
    tls = tls_files()
    interceptors = client_interceptors() if token_interceptor else []
    options = [*channel_options(max_message_bytes), *RECONNECT_OPTIONS, *keepalive_options(keepalive_s)]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=[*options, *target_name_options()],
                                   interceptors=interceptors)


async def check_health(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when the server at `address` reports SERVING for `service` ('' = whole server)."""
    async with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
