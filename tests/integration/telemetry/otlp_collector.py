"""A tiny OTLP/gRPC trace collector for tests: each span it receives becomes one JSON line.

    python -m tests.integration.telemetry.otlp_collector OUT.jsonl
      prints "otlp collector listening on 127.0.0.1:<port>" once serving; SIGTERM/SIGINT stop it.

A line: {"service", "scope", "name", "trace_id", "span_id", "parent_span_id", "attributes"}
(ids in hex, service from the resource's service.name).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, TextIO

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_SCALARS = ("string_value", "bool_value", "int_value", "double_value")


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in _SCALARS else str(value)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def Export(  # noqa: N802 (gRPC method name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        lines = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(json.dumps({
                        "service": resource.get("service.name"), "scope": scope_spans.scope.name,
                        "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
                    }) + "\n")
        with self._lock:
            self._out.write("".join(lines))
            self._out.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="JSON-lines file the spans are appended to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = the OS picks one")
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with args.out.open("a") as out:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(out), server)
        port = server.add_insecure_port(f"{args.host}:{args.port}")
        server.start()
        print(f"otlp collector listening on {args.host}:{port}", flush=True)
        stop.wait()
        server.stop(grace=2).wait()


if __name__ == "__main__":
    main()
