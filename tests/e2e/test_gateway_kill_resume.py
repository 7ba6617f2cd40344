"""A gateway killed mid-stream: gRPC's client drops the messages it had received but not yet read, so what
the killed gateway handed over (and billed) may be more than its caller read. The gateway's next run stores
what it handed over under the request's idempotency key, the SDK's stream fetches the part its caller has
not seen, and the ledger bills exactly what the caller received."""

import threading

import diptych
from diptych_server.stack import free_port
from tests.e2e.test_metering import usage_events

GATEWAY = "gateway-killed-mid-stream"
READ_BEFORE_THE_KILL = 5


def test_a_stream_cut_by_a_gateway_kill_resumes_and_bills_exactly_what_its_caller_received(live, tmp_path):
    port = free_port()
    live.stack.start_gateway(
        GATEWAY, port, free_port(), "colocated", http_port=free_port(), extra=("--state-dir", str(tmp_path))
    )
    try:
        with diptych.Client(api_key=live.api_key, base_url=f"grpc://127.0.0.1:{port}") as client:
            stream = client.completions.create(
                model="diptych-tiny", prompt=[9] * 8, max_tokens=1000, temperature=0, ignore_eos=True, stream=True
            )
            chunks = iter(stream)
            received = [next(chunks) for _ in range(READ_BEFORE_THE_KILL)]
            live.stack.kill_process(GATEWAY)
            threading.Timer(0.5, live.stack.restart_process, args=(GATEWAY,)).start()
            received += list(chunks)
        tokens = sum(len(chunk.token_ids) for chunk in received)
        assert received[-1].finish_reason == "interrupted", "the stream ran to its end: the kill came too late"
        assert all(chunk.finish_reason is None for chunk in received[:-1])
        assert stream.usage is not None and stream.usage.completion_tokens == tokens
        events = {e["phase"]: e["tokens"] for e in usage_events(live, stream.request_id, expected=2, seconds=60)}
        assert events == {"prefill": 8, "decode": tokens}
    finally:
        if GATEWAY in live.stack.processes:
            live.stack.stop_process(GATEWAY)
