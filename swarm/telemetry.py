"""Optional OpenTelemetry traces: spans for the swarm, each agent, model calls, tool calls.

On only when the OpenTelemetry SDK and its OTLP/HTTP exporter are installed and
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; otherwise every function here is a no-op that
costs a boolean test. A child's ``agent`` span is a child of its parent's ``agent`` tool
call across processes: the W3C ``traceparent`` travels with the spawn request and in the
Celery task's headers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_tracer: Any = None
_checked = False


def _setup() -> Any:
    """The process's tracer, set up on first use; None when telemetry is off."""
    global _tracer, _checked
    if _checked:
        return _tracer
    with _lock:
        if _checked:
            return _tracer
        _checked = True
        if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            return None
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            return None
        provider = TracerProvider(resource=Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME", "swarm")}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _tracer = trace.get_tracer("swarm")
        return _tracer


def enabled() -> bool:
    return _setup() is not None


@contextlib.contextmanager
def span(name: str, parent: str = "", **attributes: Any) -> Iterator[None]:
    """A span around the block (nothing when off); ``parent`` is a ``traceparent`` from
    another process to continue."""
    tracer = _setup()
    if tracer is None:
        yield
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = (TraceContextTextMapPropagator().extract({"traceparent": parent})
               if parent else None)
    attrs = {k: v if isinstance(v, str | int | float | bool) else str(v)
             for k, v in attributes.items() if v is not None}
    with tracer.start_as_current_span(name, context=context, attributes=attrs):
        yield


def traceparent() -> str:
    """The W3C ``traceparent`` of the current span ("" when off or outside a span)."""
    if _setup() is None:
        return ""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent", "")


def flush() -> None:
    """Send what is buffered (before a short-lived process exits)."""
    if _setup() is None:
        return
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    force = getattr(provider, "force_flush", None)
    if force is not None:
        force()
