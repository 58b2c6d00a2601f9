"""`shared.telemetry` without a model: when tracing turns on, that off costs nothing, and the helpers.

Whether a process installs a provider is checked in fresh subprocesses (a process
sets its global provider once); the helpers run on a private provider here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from shared.errors import CapacityError, ConfigError
from shared.telemetry import REQUEST_ID, inject_metadata, server_span, setup_tracing, trace_exporters

ROOT = Path(__file__).resolve().parents[3]

# In a fresh process: set tracing up, open a span, report what was installed.
PROBE = """
import json, sys, threading
from opentelemetry import trace
from shared.telemetry import inject_metadata, setup_tracing, tracer
threads = threading.active_count()
setup_tracing("baton-probe")
with tracer("probe").start_as_current_span("probe.span") as span:
    metadata, recording = inject_metadata(), span.is_recording()
print(json.dumps({"provider": type(trace.get_tracer_provider()).__name__,
                  "sdk_imported": "opentelemetry.sdk.trace" in sys.modules,
                  "new_threads": threading.active_count() - threads,
                  "recording": recording, "metadata": metadata}))
"""


def _probe(**otel_env: str) -> tuple[dict[str, Any], str]:
    """Run PROBE with exactly `otel_env` as its OTEL_* variables; (its report, its other output)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | otel_env
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    report = next(json.loads(line) for line in lines if line.startswith('{"provider"'))
    return report, done.stdout


@pytest.mark.parametrize("environ, expected", [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "console"}, ["console"]),
])
def test_which_exporters_the_environment_asks_for(environ: dict[str, str], expected: list[str]) -> None:
    assert trace_exporters(environ) == expected


@pytest.mark.parametrize("otel_env", [
    {},
    {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
    {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
])
def test_off_installs_nothing(otel_env: dict[str, str]) -> None:
    report, _ = _probe(**otel_env)
    assert report == {"provider": "ProxyTracerProvider", "sdk_imported": False, "new_threads": 0,
                      "recording": False, "metadata": []}


def test_console_exporter_names_the_service_and_flushes_at_exit() -> None:
    report, out = _probe(OTEL_TRACES_EXPORTER="console")
    assert report["provider"] == "TracerProvider" and report["recording"]
    assert [key for key, _ in report["metadata"]] == ["traceparent"]
    assert '"name": "probe.span"' in out and '"service.name": "baton-probe"' in out
    _, renamed = _probe(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="router-east")
    assert '"service.name": "router-east"' in renamed


def test_sigterm_flushes_buffered_spans_before_the_process_ends() -> None:
    """A span still in the batch processor's buffer (5 s schedule) is exported as SIGTERM ends the process."""
    code = ("import os, signal, time\n"
            "from shared.telemetry import setup_tracing, tracer\n"
            "setup_tracing('baton-probe')\n"
            "tracer('probe').start_span('before.sigterm').end()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_TRACES_EXPORTER"] = "console"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 128 + 15, done.stderr
    assert '"name": "before.sigterm"' in done.stdout


def test_unsupported_exporter_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="zipkin"):
        setup_tracing("baton-test")


class _GrpcContext:
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def test_server_span_continues_the_callers_trace() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        metadata = inject_metadata()
    assert dict(metadata)["traceparent"].split("-")[1] == format(caller.get_span_context().trace_id, "032x")
    with server_span(tracer, _GrpcContext(metadata), "svc.Method", {REQUEST_ID: "r-1"}):
        pass
    with pytest.raises(CapacityError), server_span(tracer, _GrpcContext(metadata), "svc.Full"):
        raise CapacityError("store full")
    with server_span(tracer, _GrpcContext([]), "svc.Untraced"):
        pass
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    served, full, untraced = by_name["svc.Method"], by_name["svc.Full"], by_name["svc.Untraced"]
    assert served.kind is SpanKind.SERVER and dict(served.attributes or {})[REQUEST_ID] == "r-1"
    assert served.parent is not None and served.parent.span_id == caller.get_span_context().span_id
    assert served.context.trace_id == caller.get_span_context().trace_id
    assert full.status.status_code is StatusCode.ERROR
    assert dict(full.attributes or {})["rpc.grpc.status_code"] == 8  # RESOURCE_EXHAUSTED
    assert untraced.parent is None  # no metadata: a trace of its own


def test_inject_metadata_without_a_span_is_empty() -> None:
    assert inject_metadata() == []
