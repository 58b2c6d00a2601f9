"""A minimal OTLP/gRPC trace receiver: one JSON line per span on stdout.

    python otlp_receiver.py --host 127.0.0.1 --port 4317
      <- opentelemetry.proto.collector.trace.v1.TraceService/Export (what every baton service's
         OTLP exporter sends)
      -> {"service": "baton-router", "name": "POST /v1/chat/completions", "trace_id": "…", "span_id": "…"}

For machines where no collector image can be pulled (the compose overlay host-network.yml runs it
in the baton image, which has grpcio and opentelemetry-proto). It keeps nothing: point the services
at a real collector (deploy/compose/otel-collector.yaml) to store or forward spans.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from concurrent import futures
from types import FrameType

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

logger = logging.getLogger("otlp_receiver")


def _service_name(resource_spans: object) -> str:
    for attribute in resource_spans.resource.attributes:  # type: ignore[attr-defined]
        if attribute.key == "service.name":
            return str(attribute.value.string_value)
    return ""


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        # Exports arrive on several server threads at once; print() writes a line and its newline in two
        # calls, so two spans could share a line (seen: "{...}{...}" in the compose test's log)
        self._stdout = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802 (the proto's name)
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = _service_name(resource_spans)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    line = {"service": service, "name": span.name, "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(), "parent_span_id": span.parent_span_id.hex()}
                    with self._stdout:
                        sys.stdout.write(json.dumps(line) + "\n")
                        sys.stdout.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceReceiver(), server)
    server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    logger.info("OTLP/gRPC trace receiver on %s:%d", args.host, args.port)

    def stop(signum: int, frame: FrameType | None) -> None:
        server.stop(grace=2)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
