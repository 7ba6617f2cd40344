"""OpenTelemetry tracing shared by the gateway and the workers: one trace per request.

Off by default: until `configure_tracing` installs an SDK provider (it does so when an OTLP endpoint is
given, by flag or `OTEL_EXPORTER_OTLP_ENDPOINT`), every span is the API's no-op span, so a request costs a
handful of no-op calls and nothing per token. Spans are made with explicit parents (`parent=`) rather
than the current context, because requests run through async generators that a task may leave between
two steps.

The trace context travels as a W3C `traceparent`: in gRPC metadata (gateway → workers) and in the KV
data path's hello (prefill → decode worker)."""

import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from diptych_common.logs import describe_error

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER = trace.get_tracer("diptych")  # a proxy until a provider is set, then that provider's tracer


def configure_tracing(service_name: str, endpoint: str = "") -> bool:
    """Exports spans over OTLP/gRPC to `endpoint` (or OTEL_EXPORTER_OTLP_ENDPOINT); does nothing without
    one. True when tracing is on."""
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return True


def start_span(
    name: str,
    parent: Span | Context | None = None,
    start_ns: int | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, str | int | float | bool] | None = None,
) -> Span:
    """A span under `parent` (a span, or a context taken from a carrier); a new trace when None."""
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    return _TRACER.start_span(name, context, kind, attributes=attributes, start_time=start_ns)


def record_span(
    name: str, parent: Span | Context | None, start_ns: int, end_ns: int, **attributes: str | int | float | bool
) -> Span:
    """A span for work that already happened (a request's time in a queue, a transfer a thread timed)."""
    span = start_span(name, parent, start_ns, attributes=attributes)
    span.end(end_time=max(start_ns, end_ns))
    return span


@contextmanager
def ending(span: Span) -> Iterator[Span]:
    """Ends `span` when the block ends; an error marks it failed, with the error's type and message."""
    try:
        yield span
    except Exception as error:
        span.set_status(StatusCode.ERROR, describe_error(error))
        raise
    finally:
        span.end()


def now_ns() -> int:
    """Span timestamps: wall-clock nanoseconds, comparable across the processes of one host."""
    return time.time_ns()


def traceparent_of(span: Span) -> str:
    """`span`'s context as a W3C traceparent; empty when it is not a real (sampled or remote) span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def grpc_metadata(span: Span) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `span`'s context (none when tracing is off)."""
    value = traceparent_of(span)
    return ((TRACEPARENT, value),) if value else ()


def context_from_traceparent(value: str) -> Context:
    return _PROPAGATOR.extract({TRACEPARENT: value} if value else {})


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from a server call's invocation metadata."""
    for key, value in metadata or ():
        if key == TRACEPARENT and isinstance(value, str):
            return context_from_traceparent(value)
    return Context()


def trace_id_of(span: Span) -> str:
    """The span's trace id in hex, as log lines carry it; empty for a no-op span."""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""
