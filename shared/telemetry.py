"""OpenTelemetry tracing for every baton service: one trace per request across all four.

    router   SERVER "POST /v1/chat/completions"   baton.request_id, gen_ai.usage.*, baton.stream
      ├─ prefill      SERVER "prefill.Prefill"     prompt/cached tokens, handoff bytes and blocks
      │    └─ kv_transfer SERVER "kv_transfer.Put"     handoff id, bytes and blocks received
      ├─ decode       SERVER "decode.Generate"     output tokens, blocks claimed
      │    └─ kv_transfer SERVER "kv_transfer.Claim"   handoff id, bytes and blocks sent
      └─ (on abort)   "prefill.Abort", "decode.Abort", "kv_transfer.Release"

The context crosses gRPC as W3C `traceparent`/`tracestate` metadata: a caller passes
`metadata=inject_metadata()` on each stub call; a servicer method opens
`server_span(tracer, context, name)`, which continues the caller's trace.

Configuration is the standard OTEL_* environment and nothing else. This module is the
one place in baton that looks at it (everything else is configured by `BATON_*`
settings); the SDK reads the rest itself (endpoint, headers, OTEL_EXPORTER_OTLP_INSECURE,
OTEL_BSP_*, OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES, OTEL_PROPAGATORS). Tracing is
on when OTEL_TRACES_EXPORTER names an exporter (otlp, console) or, with it unset, an OTLP
endpoint is given; OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turns it off.

When on, a SIGTERM that nothing else handles ends the process through SystemExit so the
buffered spans are flushed at exit. Off costs nothing worth measuring: no provider is
installed and the SDK is not even imported, so the API's no-op tracer hands out one
shared non-recording span, and `inject_metadata()` returns an empty list (unless a
client's own trace came in).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from shared.errors import ConfigError
from shared.grpc_errors import status_for_error

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

# span attribute names, one place for all services
REQUEST_ID = "baton.request_id"
HANDOFF_ID = "baton.handoff_id"
STREAM = "baton.stream"
INPUT_TOKENS = "gen_ai.usage.input_tokens"  # prompt tokens
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"  # completion tokens
CACHED_TOKENS = "baton.num_cached_tokens"  # prompt tokens served from the prefix cache
KV_NBYTES = "baton.kv.nbytes"  # KV + hidden-state bytes moved through kv_transfer
KV_NUM_BLOCKS = "baton.kv.num_blocks"  # KV blocks per layer in the handoff
KV_SECONDS = "baton.kv.seconds"  # first transfer posted to last one done
KV_GBPS = "baton.kv.gbps"  # nbytes / seconds

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_installed = False


def trace_exporters(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the OTEL_* variables in `environ` ask for; empty = tracing off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        # the spec's default is otlp; follow it only when told where to send, so that a
        # process started with no OTEL_* at all never dials localhost:4317
        return ["otlp"] if any(environ.get(v) for v in _ENDPOINT_VARS) else []
    return [] if "none" in names else names


def setup_tracing(service_name: str) -> None:
    """Install a tracer provider for this process when the OTEL_* variables ask for one.

    Call once from the service's `main`, after logging is configured. `service_name`
    is the default `service.name`; OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES)
    wins. Spans still buffered are flushed when the process exits, SIGTERM included.
    """
    global _installed
    names = trace_exporters(os.environ)
    if not names or _installed:
        return
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name, os.environ) for name in names]
    resource = Resource.create({SERVICE_NAME: service_name}).merge(OTELResourceDetector().detect())
    provider: TracerProvider = TracerProvider(resource=resource)  # shuts down (flushes) at exit
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _exit_on_sigterm()
    _installed = True
    logger.info("tracing on: service %s, exporters %s", resource.attributes.get(SERVICE_NAME),
                ",".join(names))


def _exit_on_sigterm() -> None:
    """Let a SIGTERM nobody handles end the process through SystemExit, so atexit flushes spans.

    Its default action kills the process on the spot, skipping atexit and `finally` blocks;
    uvicorn re-raises SIGTERM that way after its graceful shutdown. The exit status is 143,
    the conventional 128 + SIGTERM. Services that handle SIGTERM themselves are unaffected.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ConfigError(f"OTEL_TRACES_EXPORTER={name} is not supported here (otlp, console or none)")
    protocol = next((environ[v] for v in _PROTOCOL_VARS if environ.get(v)), "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HTTPSpanExporter,
            )
        except ImportError:
            raise ConfigError("OTLP over http/protobuf needs opentelemetry-exporter-otlp-proto-http; "
                              "install it or set OTEL_EXPORTER_OTLP_PROTOCOL=grpc") from None
        return HTTPSpanExporter()
    raise ConfigError(f"OTLP protocol {protocol!r} is not supported (grpc or http/protobuf)")


def tracer(name: str) -> trace.Tracer:
    """A tracer for one module; it follows whatever provider is installed, now or later."""
    return trace.get_tracer(name)


def inject_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the W3C trace context of `context` (default: the current one)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


def extract_http(headers: Mapping[str, str]) -> Context:
    """The client's trace context from HTTP request headers (W3C traceparent/tracestate)."""
    return propagate.extract(headers)


def extract_context(grpc_context: Any) -> Context:
    """The caller's trace context from a grpc.aio servicer context's invocation metadata."""
    metadata = (grpc_context.invocation_metadata() if grpc_context is not None else None) or ()
    return propagate.extract({key: value for key, value in metadata if isinstance(value, str)})


@contextmanager
def server_span(
    tracer: trace.Tracer, grpc_context: Any, name: str, attributes: Mapping[str, AttributeValue] | None = None
) -> Iterator[Span]:
    """A SERVER span around a servicer method, continuing the caller's trace.

    For unary methods, and for server-streaming ones written as a coroutine that calls
    `context.write`: an async generator holding the span across a `yield` is closed, when
    its call is cancelled, by the event loop's finalizer in another context, and the span's
    context cannot be detached there. An exception marks the span as an error with the gRPC
    status it will be sent as; a cancelled call just ends the span.
    """
    attrs = {"rpc.system": "grpc", **(attributes or {})}
    with tracer.start_as_current_span(name, context=extract_context(grpc_context), kind=SpanKind.SERVER,
                                      attributes=attrs) as span:
        try:
            yield span
        except Exception as e:
            span.set_attribute("rpc.grpc.status_code", status_for_error(e).value[0])
            raise
