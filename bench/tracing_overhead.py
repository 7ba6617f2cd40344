"""What tracing costs one split request: the span work the gateway and both workers do for it
(`diptych_common/tracing.py`; none of it per token), with tracing off (the OpenTelemetry API's no-op
spans) and on (the SDK, spans handed to an in-memory exporter). `python -m bench.tracing_overhead [--requests N]`."""

import argparse
import time

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from diptych_common.tracing import (
    context_from_metadata,
    context_from_traceparent,
    grpc_metadata,
    now_ns,
    record_span,
    start_span,
    traceparent_of,
)


def one_split_request() -> None:
    """The spans of one split request, made as the gateway and the workers make them."""
    root = start_span("gateway.request")
    attempt = start_span("gateway.attempt", root)
    metadata = grpc_metadata(attempt)
    prefill = start_span("worker.prefill", context_from_metadata(metadata))
    transfer = start_span("kv.transfer", prefill)
    hello = traceparent_of(transfer)
    decode = start_span("worker.decode", context_from_metadata(metadata))
    t = now_ns()
    for parent, name in ((prefill, "worker.queue"), (prefill, "prefill.compute"), (decode, "worker.queue")):
        record_span(name, parent, t, t + 1000)
    record_span("kv.receive", context_from_traceparent(hello), t, t + 1000)
    record_span("decode.compute", decode, t, t + 1000)
    for span in (transfer, prefill, decode, attempt, root):
        span.end()


def microseconds_per_request(requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        one_split_request()
    return (time.perf_counter() - started) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    off = microseconds_per_request(args.requests)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    on = microseconds_per_request(args.requests)
    spans = len(exporter.get_finished_spans()) / args.requests
    print(f"tracing off: {off:.1f} µs of span work per split request")
    print(f"tracing on:  {on:.1f} µs per split request ({spans:.0f} spans, in-memory exporter)")


if __name__ == "__main__":
    main()
