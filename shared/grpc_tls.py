"""Mutual TLS on every internal gRPC channel, the stronger sibling of the shared token (grpc_auth.py).

```
 service start ─► set_tls(settings.tls_dir, service)   (None = plaintext; the token mode still applies)
                    reads ca.pem, <service>.pem, <service>-key.pem (`baton certs` makes a dev set)
 make_server() ─► a TLS port that demands a client certificate signed by ca.pem (the handshake refuses
                  anything else: no certificate, another CA's, an expired one)
                  + PeerCertInterceptor: a CA-signed certificate without the SAN baton-internal is not a
                    service's ─► UNAUTHENTICATED, counted in baton_grpc_unauthenticated_total
 channel()     ─► presents <service>.pem and checks the server's against ca.pem and the name
                  baton-internal (not the address: registry addresses are pod IPs)
```

A caller refused at the handshake never reaches the application, so gRPC cannot count it here: it
sees UNAVAILABLE and the server's gRPC core logs the failed handshake.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from shared.errors import ConfigError
from shared.grpc_auth import count_refusal, refusing_handler, set_internal_token
from shared.tls_certs import TLS_TARGET_NAME

__all__ = ["PeerCertInterceptor", "configure_internal_auth", "TlsFiles", "channel_credentials", "load_tls", "server_credentials", "set_tls",
           "target_name_options", "tls_files"]

logger = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes one process authenticates with."""

    ca: bytes
    cert: bytes
    key: bytes


_state: dict[str, TlsFiles | None] = {"tls": None}


def load_tls(tls_dir: Path, service: str) -> TlsFiles:
    """`tls_dir`/ca.pem and the service's pair; ConfigError naming what is missing."""
    paths = [tls_dir / "ca.pem", tls_dir / f"{service}.pem", tls_dir / f"{service}-key.pem"]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"TLS files missing: {', '.join(missing)} (`baton certs --out {tls_dir}` makes a set)")
    ca, cert, key = (p.read_bytes() for p in paths)
    return TlsFiles(ca, cert, key)


def set_tls(tls_dir: Path | None, service: str) -> None:
    """Use mutual TLS for this process's servers and channels (None: plaintext)."""
    _state["tls"] = load_tls(tls_dir, service) if tls_dir is not None else None


def configure_internal_auth(token: str, tls_dir: Path | None, service: str) -> None:
    """What a service's main sets before anything serves or dials: the shared token and/or mutual TLS."""
    set_internal_token(token)
    set_tls(tls_dir, service)


def tls_files() -> TlsFiles | None:
    return _state["tls"]


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(files.key, files.cert)], root_certificates=files.ca,
                                       require_client_auth=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=files.ca, private_key=files.key,
                                        certificate_chain=files.cert)


def target_name_options() -> list[tuple[str, str]]:
    """Check the server's certificate against baton-internal, whatever address was dialled."""
    return [("grpc.ssl_target_name_override", TLS_TARGET_NAME), ("grpc.default_authority", TLS_TARGET_NAME)]


class PeerCertInterceptor(grpc.aio.ServerInterceptor):
    """With TLS on: refuse a caller whose certificate (signed by the CA: the handshake checked) is not a
    service's, i.e. lacks the SAN baton-internal. Health checks stay open, as in the token mode."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if tls_files() is None or handler is None or (handler_call_details.method or "").startswith(_HEALTH_PREFIX):
            return handler
        return _checking_peer(handler)


def _peer_is_a_service(context: grpc.aio.ServicerContext) -> bool:
    names = context.auth_context().get("x509_subject_alternative_name", [])
    return any(n == TLS_TARGET_NAME.encode() for n in names)


def _refuses_peer(context: grpc.aio.ServicerContext) -> bool:
    """True (and the refusal counted) when the caller's certificate is not a baton service's."""
    if _peer_is_a_service(context):
        return False
    count_refusal("not a service certificate")
    return True


def _checking_peer(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler`, preceded by the peer check (the auth context is only known once the call runs)."""
    refuse = refusing_handler(handler, "client certificate is not a baton service's (SAN baton-internal)")

    def wrap(behaviour: Callable, refused: Callable) -> Callable:
        async def unary(request: object, context: grpc.aio.ServicerContext) -> object:
            if _refuses_peer(context):
                return await refused(request, context)
            return await behaviour(request, context)

        async def streaming(request: object, context: grpc.aio.ServicerContext) -> object:
            if _refuses_peer(context):
                async for _ in refused(request, context):
                    yield _  # pragma: no cover (the refusal aborts)
                return
            async for item in behaviour(request, context):
                yield item

        async def writing(request: object, context: grpc.aio.ServicerContext) -> None:
            """A streaming method written as a coroutine that calls `context.write` (decode's Generate)."""
            if _refuses_peer(context):
                async for _ in refused(request, context):
                    pass  # pragma: no cover (the refusal aborts)
                return
            await behaviour(request, context)

        if not handler.response_streaming:
            return unary
        # grpc.aio drives a handler by its function type (iterate a generator, await a coroutine): keep it
        return streaming if inspect.isasyncgenfunction(behaviour) else writing

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            wrap(handler.stream_stream, refuse.stream_stream), handler.request_deserializer, handler.response_serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            wrap(handler.stream_unary, refuse.stream_unary), handler.request_deserializer, handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream, refuse.unary_stream), handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        wrap(handler.unary_unary, refuse.unary_unary), handler.request_deserializer, handler.response_serializer)
