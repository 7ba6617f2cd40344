"""Log lines (text or JSON, with the request and trace ids of the request they are about; errors with
their type even when their message is empty) and what the public HTTP port serves of the metrics."""

import asyncio
import io
import json
import logging
import os
import socket
import sys

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from diptych_common.logs import bind_request, describe_error, handler_for, log_format
from diptych_common.tracing import configure_tracing
from tests.gateway.harness import API_KEY, in_process_gateway
from workers.serving.registration import ControlPlaneLink

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture
def json_lines():
    """JSON lines that loggers under `tests.observability` write, parsed."""
    stream = io.StringIO()
    handler = handler_for("json", stream)
    logger = logging.getLogger("tests.observability")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    logger.removeHandler(handler)


async def test_every_line_a_request_task_logs_names_its_request_and_trace(json_lines):
    log = logging.getLogger("tests.observability")

    async def serve(request_id: str, trace_id: str) -> None:
        bind_request(request_id, trace_id)
        await asyncio.sleep(0)  # another request's task runs in between
        log.info("serving")

    await asyncio.gather(asyncio.create_task(serve("exec_a", TRACE_ID)), asyncio.create_task(serve("exec_b", "")))
    log.info("not about a request")
    lines = json_lines()
    assert {(line["message"], line.get("request_id"), line.get("trace_id")) for line in lines} == {
        ("serving", "exec_a", TRACE_ID),
        ("serving", "exec_b", None),
        ("not about a request", None, None),
    }
    assert all(line["level"] == "INFO" and line["logger"] == "tests.observability" for line in lines)


def test_an_exception_logged_as_json_carries_its_type_and_message(json_lines):
    try:
        raise TimeoutError()
    except TimeoutError:
        logging.getLogger("tests.observability").exception("the step failed")
    (line,) = json_lines()
    assert line["error_type"] == "TimeoutError" and line["error_message"] == ""
    assert "Traceback" in line["traceback"]


def test_an_error_with_an_empty_message_is_described_by_its_type():
    assert describe_error(TimeoutError()) == "TimeoutError"
    assert describe_error(ValueError("bad value")) == "ValueError: bad value"


def test_text_lines_end_with_the_request_and_trace_ids():
    stream = io.StringIO()
    handler = handler_for("text", stream)
    record = logging.LogRecord("gateway", logging.WARNING, __file__, 1, "moved", None, None)
    record.request_id, record.trace_id = "exec_a", TRACE_ID
    assert handler.filter(record)
    handler.emit(record)
    assert stream.getvalue().rstrip().endswith(f"moved [request=exec_a trace={TRACE_ID}]")


def test_a_log_format_other_than_text_or_json_is_refused(monkeypatch):
    monkeypatch.setenv("DIPTYCH_LOG_FORMAT", "JSON")
    assert log_format() == "json"
    monkeypatch.setenv("DIPTYCH_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="DIPTYCH_LOG_FORMAT / --log-format must be one of text, json, not 'xml'"):
        log_format()


async def test_a_heartbeat_that_times_out_says_so(caplog):
    """A control plane that accepts the connection and never answers: httpx raises a ReadTimeout whose
    message is empty, and the warning still names it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        link = ControlPlaneLink(url, "fleet-token", "127.0.0.1:1", "w", lambda: {}, http_timeout_s=0.2)
        link.worker_id, link.heartbeat_interval = "wrk_1", 0.01
        beating = asyncio.create_task(link.heartbeat_forever())
        try:
            with caplog.at_level(logging.WARNING, logger="workers.serving.registration"):
                while not any("heartbeat failed" in r.getMessage() for r in caplog.records):
                    await asyncio.sleep(0.05)
        finally:
            beating.cancel()
            await link.close()
    (message,) = {r.getMessage() for r in caplog.records if "heartbeat failed" in r.getMessage()}
    assert message == "heartbeat failed: ReadTimeout"


@pytest.mark.parametrize("credential", [None, API_KEY])
async def test_the_public_http_port_serves_no_metrics(tmp_path, credential):
    headers = {"Authorization": f"Bearer {credential}"} if credential else {}
    async with in_process_gateway(tmp_path) as gateway:
        async with gateway.http.get("/metrics", headers=headers) as response:
            body = await response.text()
        async with gateway.http.get("/health") as health:
            assert health.status == 200
    assert response.status == 404
    assert "diptych_gateway" not in body


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: what a collector is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_an_otlp_endpoint_turns_tracing_on_and_spans_reach_the_collector():
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    program = (
        "from opentelemetry import trace\n"
        "from diptych_common.tracing import configure_tracing, start_span\n"
        "assert configure_tracing('diptych-gateway')\n"
        "start_span('gateway.request').end()\n"
        "trace.get_tracer_provider().shutdown()\n"
    )
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    try:
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", program, env=env)
        assert await process.wait() == 0
    finally:
        await server.stop(None)
    (resource_spans,) = [r for request in collector.requests for r in request.resource_spans]
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
    assert service == "diptych-gateway"
    assert [s.name for scope in resource_spans.scope_spans for s in scope.spans] == ["gateway.request"]


def test_without_an_endpoint_tracing_stays_off(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert configure_tracing("diptych-gateway") is False
