"""An operator can follow one request through the logs: the gateway and both workers it ran on each write
a line naming the request when their part of it ends."""

import random
import time

import diptych

PROCESSES = ("gateway-split", "prefill-0", "decode-0")


def lines_naming(live, request_id: str, seconds: float = 10.0) -> dict[str, list[str]]:
    deadline = time.monotonic() + seconds
    while True:
        found = {
            name: [line for line in live.stack.log_path(name).read_text().splitlines() if request_id in line]
            for name in PROCESSES
        }
        if all(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_the_gateway_and_both_workers_log_the_end_of_a_request_by_its_id(live):
    prompt = [random.randrange(10, 500) for _ in range(40)]  # in no prefix cache: the request runs split
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as client:
        completion = client.completions.create(model="diptych-tiny", prompt=prompt, max_tokens=6, temperature=0)
    found = lines_naming(live, completion.id)
    assert all(found.values()), f"no line names {completion.id} in: {[n for n, lines in found.items() if not lines]}"
    (gateway_line,) = found["gateway-split"]
    assert "grpc split request of diptych-tiny ended OK: 40 prompt and 6 output tokens" in gateway_line
    assert any("prefill call done" in line and "40 prompt tokens" in line for line in found["prefill-0"])
    assert any("decode call done" in line for line in found["decode-0"])
