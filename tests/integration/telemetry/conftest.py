"""Telemetry fixtures: an in-memory span exporter on this test process's global tracer provider.

OpenTelemetry lets a process set its global provider once, so the fixture is
session-wide: it installs an SDK provider if none is set (or adds its processor to
the one that is) and stops collecting when the session ends.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@pytest.fixture(scope="session")
def span_exporter() -> Iterator[InMemorySpanExporter]:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider(resource=Resource.create({SERVICE_NAME: "baton-tests"})))
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "another library set a non-SDK global tracer provider"
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exports as each span ends
    yield exporter
    exporter.shutdown()  # later spans in this process are dropped, not kept in memory


@pytest.fixture
def spans(span_exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    """The session exporter, emptied before the test."""
    span_exporter.clear()
    yield span_exporter
