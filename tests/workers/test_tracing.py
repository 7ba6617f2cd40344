"""One trace per request: the gateway's spans, the workers' (their context carried in gRPC metadata) and
the KV receive (its context carried in the KV hello), read back with the SDK's in-memory exporter over
an in-process gateway and real workers of the tiny model."""

import io
import json
import logging
from collections import defaultdict

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, StatusCode

from diptych_common.logs import handler_for
from diptych_common.tracing import context_from_traceparent, grpc_metadata, start_span, traceparent_of
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.accounts.usage import UsageReporter
from gateway.routing.route import ServingMode
from tests.gateway.harness import MODEL
from tests.workers.conftest import prompts, wait_until
from tests.workers.kv_wire import LAYOUT, TOKEN
from tests.workers.test_gateway_sampling_controls import AUTH, SPLIT, gateway_over
from workers.kv_connector.wire import encode_hello


class _WhileTesting(SimpleSpanProcessor):
    """Keeps spans only during a test that asked for them: the SDK provider, set once per process (as
    OpenTelemetry allows), stays for the tests that follow."""

    active = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.active:
            super().on_end(span)


_EXPORTER = InMemorySpanExporter()
_PROCESSOR = _WhileTesting(_EXPORTER)


@pytest.fixture
def spans():
    """Spans recorded from here on, read back with the in-memory exporter."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(_PROCESSOR)
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    _PROCESSOR.active = True
    yield _EXPORTER
    _PROCESSOR.active = False
    _EXPORTER.clear()


def request(prompt: list[int], count: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        model=MODEL, prompt_token_ids=inference_pb2.TokenIds(ids=prompt), max_tokens=count, temperature=0.0
    )


def tree(finished: list[ReadableSpan]) -> str:
    """The spans as an indented tree, children in start order (what docs/observability.md shows)."""
    children: dict[int | None, list[ReadableSpan]] = defaultdict(list)
    for span in finished:
        children[span.parent.span_id if span.parent else None].append(span)
    lines: list[str] = []

    def walk(parent_id: int | None, depth: int) -> None:
        for span in sorted(children[parent_id], key=lambda s: s.start_time or 0):
            assert span.start_time is not None and span.end_time is not None
            ms = (span.end_time - span.start_time) / 1e6
            failed = " ERROR" if span.status.status_code is StatusCode.ERROR else ""
            lines.append(f"{'  ' * depth}{span.name} ({ms:.1f} ms){failed}")
            walk(span.context.span_id, depth + 1)

    walk(None, 0)
    return "\n".join(lines)


def by_name(finished: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = defaultdict(list)
    for span in finished:
        named[span.name].append(span)
    return named


def parent_of(span: ReadableSpan, finished: list[ReadableSpan]) -> ReadableSpan:
    assert span.parent is not None, f"{span.name} has no parent"
    return next(s for s in finished if s.context.span_id == span.parent.span_id)


def starts_within(child: ReadableSpan, parent: ReadableSpan) -> bool:
    assert child.start_time is not None and parent.start_time is not None and parent.end_time is not None
    return parent.start_time <= child.start_time <= parent.end_time


def within(child: ReadableSpan, parent: ReadableSpan) -> bool:
    assert child.end_time is not None and parent.end_time is not None
    return starts_within(child, parent) and child.end_time <= parent.end_time


async def test_a_split_request_is_one_trace_from_the_gateway_through_the_kv_transfer_to_usage_ingest(
    tmp_path, tiny_model, executor, spans
):
    async with gateway_over(tmp_path, tiny_model, executor, SPLIT, ServingMode.SPLIT) as (gateway, _):
        stub = inference_pb2_grpc.InferenceStub(gateway.channel)
        responses = [r async for r in stub.Generate(request(prompts([40], salt=61)[0], 6), metadata=AUTH)]
        assert sum(len(r.token_ids) for r in responses) == 6
        await UsageReporter(gateway.control_plane, gateway.journal).flush()
        names = ["worker.decode", "decode.compute", "usage.ingest"]
        assert await wait_until(lambda: all(by_name(spans.get_finished_spans())[n] for n in names), timeout=5)
    finished = list(spans.get_finished_spans())
    print(tree(finished))
    named = by_name(finished)
    (root,) = named["gateway.request"]
    assert {span.context.trace_id for span in finished} == {root.context.trace_id}
    assert root.parent is None and root.attributes is not None and root.attributes["outcome"] == "OK"
    expected_parents = {
        "gateway.attempt": "gateway.request",
        "worker.prefill": "gateway.attempt",
        "worker.decode": "gateway.attempt",
        "prefill.compute": "worker.prefill",
        "kv.transfer": "worker.prefill",
        "kv.receive": "kv.transfer",  # across the KV data path, by the hello's traceparent
        "decode.compute": "worker.decode",
        "usage.ingest": "gateway.request",
    }
    for name, parent in expected_parents.items():
        (span,) = named[name]
        assert parent_of(span, finished).name == parent, name
    assert sorted(parent_of(s, finished).name for s in named["worker.queue"]) == ["worker.decode", "worker.prefill"]
    for span in finished:  # every span starts inside its parent; usage goes to the control plane afterwards
        if span.parent is not None and span.name != "usage.ingest":
            assert starts_within(span, parent_of(span, finished)), span.name
    for name in ("worker.queue", "prefill.compute", "kv.transfer", "decode.compute", "kv.receive"):
        for span in named[name]:  # one process's clock, or ended before the parent could end
            assert within(span, parent_of(span, finished)), name
    (ingest,) = named["usage.ingest"]
    (posted,) = gateway.control_plane.usage_headers  # the control plane is told the ingest span's context
    assert posted["traceparent"].split("-")[1:3] == [
        format(root.context.trace_id, "032x"),
        format(ingest.context.span_id, "016x"),
    ]
    (compute,) = named["prefill.compute"]
    (prefill_queue,) = [s for s in named["worker.queue"] if parent_of(s, finished).name == "worker.prefill"]
    assert prefill_queue.end_time == compute.start_time  # queueing ends where the compute begins


async def test_a_migrated_requests_trace_shows_both_attempts(tmp_path, tiny_model, executor, spans):
    """... and the gateway's warning about the move names the request and its trace."""
    count = 120
    lines = io.StringIO()
    handler = handler_for("json", lines)
    logging.getLogger("gateway").addHandler(handler)
    async with gateway_over(tmp_path, tiny_model, executor, SPLIT, ServingMode.SPLIT) as (gateway, workers):
        stub = inference_pb2_grpc.InferenceStub(gateway.channel)
        received, killed = 0, None
        async for response in stub.Generate(request(prompts([40], salt=62)[0], count), metadata=AUTH):
            received += len(response.token_ids)
            if killed is None and received >= 8:
                killed = next(w for w in ("decode-0", "decode-1") if workers[w].engine.stats().running)
                await workers.pop(killed).stop()
        assert killed is not None and received == count
    logging.getLogger("gateway").removeHandler(handler)
    finished = list(spans.get_finished_spans())
    print(tree(finished))
    named = by_name(finished)
    (root,) = named["gateway.request"]
    assert {span.context.trace_id for span in finished} == {root.context.trace_id}
    attempts = sorted(named["gateway.attempt"], key=lambda s: s.start_time or 0)
    assert [parent_of(a, finished).name for a in attempts] == ["gateway.request", "gateway.request"]
    first, second = attempts
    assert first.status.status_code is StatusCode.ERROR
    assert first.attributes is not None and second.attributes is not None
    assert first.attributes["decode.worker"] == killed and second.attributes["decode.worker"] != killed
    assert second.attributes["attempt"] == 2 and second.attributes["tokens_already_sent"] >= 8
    prefills = sorted(named["worker.prefill"], key=lambda s: s.start_time or 0)
    assert [parent_of(p, finished).context.span_id for p in prefills] == [a.context.span_id for a in attempts]
    decodes_of_second = [d for d in named["worker.decode"] if parent_of(d, finished) is second]
    assert len(decodes_of_second) == 1
    (moved,) = [json.loads(line) for line in lines.getvalue().splitlines() if "moving the stream" in line]
    assert moved["level"] == "WARNING" and moved["request_id"] == root.attributes["request_id"]
    assert moved["trace_id"] == format(root.context.trace_id, "032x")


def test_tracing_off_carries_nothing_and_an_untraced_hello_is_unchanged():
    """With no SDK span (tracing off) no metadata goes out and the KV hello has no traceparent key: an
    older receiver sees exactly the hello it knows."""
    assert grpc_metadata(INVALID_SPAN) == ()
    assert traceparent_of(INVALID_SPAN) == ""
    assert b"traceparent" not in encode_hello("r", TOKEN, LAYOUT, 32, "tcp", "")


def test_a_remote_context_passes_through_an_unrecorded_span():
    """A worker with tracing off still hands the gateway's trace on to the decode worker."""
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span = start_span("kv.transfer", context_from_traceparent(traceparent))
    assert traceparent_of(span).split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
