"""Interactive latency with and without a Batch API batch running beside it, on a live split platform
(diptych-tiny, one prefill and one decode worker, the gateway and the Celery jobs running batches).

The same interactive requests (streamed chat completions, one at a time) run first on an idle platform,
then while a batch runs through the same gateway at batch priority, at most `--batch-concurrency` of its
lines at once. It prints time to first token and request time (p50/p90) for both runs, side by side, and
how many batch lines finished during the second run.

    .venv/bin/python -m bench.batch_interference [--requests 20] [--batch-lines 200] [--batch-concurrency 2]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import openai

from bench.live_platform import start_platform
from bench.stats import percentile
from diptych_server.stack import free_port

MODEL = "diptych-tiny"


def interactive_run(client: openai.OpenAI, requests: int, max_tokens: int) -> tuple[list[float], list[float]]:
    """(time to first token, request time) of each request, in seconds."""
    ttfts, totals = [], []
    for index in range(requests):
        started = time.perf_counter()
        first = None
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Interactive question {index}"}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
        totals.append(time.perf_counter() - started)
        ttfts.append(first if first is not None else totals[-1])
    return ttfts, totals


def start_batch(client: openai.OpenAI, lines: int, max_tokens: int) -> str:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    rows = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**body, "messages": [{"role": "user", "content": f"Batch question {i}"}]},
        }
        for i in range(lines)
    ]
    content = "".join(json.dumps(row) + "\n" for row in rows).encode()
    uploaded = client.files.create(file=("bench.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id


def completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def row(label: str, ttfts: list[float], totals: list[float]) -> str:
    figures = [percentile(values, q) * 1000 for values in (ttfts, totals) for q in (50, 90)]
    return f"{label:<22}" + "".join(f"{value:>12.1f}" for value in figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-lines", type=int, default=200)
    parser.add_argument("--batch-concurrency", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="diptych-batch-bench-") as directory:
        platform = start_platform(Path(directory), MODEL, 1024, 1, 1, lambda message: print(f"# {message}"))
        try:
            stack = platform.stack
            for role in ("prefill", "decode"):
                stack.start_worker(f"{role}-0", role, platform.fleet_tokens[role], free_port(), "--threads", "1")
            stack.wait_for_workers(["prefill-0", "decode-0"], timeout=300)
            http_port = free_port()
            stack.start_gateway("gateway", free_port(), free_port(), "split", http_port=http_port)
            base_url = f"http://127.0.0.1:{http_port}/v1"
            stack.start_jobs(
                DIPTYCH_GATEWAY_URL=base_url, DIPTYCH_BATCH_MAX_CONCURRENT_LINES=str(args.batch_concurrency)
            )
            client = openai.OpenAI(base_url=base_url, api_key=platform.api_key, max_retries=0)
            interactive_run(client, 3, args.max_tokens)  # warm-up
            idle = interactive_run(client, args.requests, args.max_tokens)
            batch_id = start_batch(client, args.batch_lines, args.max_tokens)
            while completed(client, batch_id) == 0:
                time.sleep(0.2)  # waiting for the batch to start, not measuring
            done_before = completed(client, batch_id)
            busy = interactive_run(client, args.requests, args.max_tokens)
            done_during = completed(client, batch_id) - done_before
            client.batches.cancel(batch_id)
        finally:
            platform.stop()
    print(f"\n{args.requests} interactive requests, max_tokens {args.max_tokens}; times in ms")
    print(f"{'':<22}{'TTFT p50':>12}{'TTFT p90':>12}{'total p50':>12}{'total p90':>12}")
    print(row("idle", *idle))
    print(row(f"batch beside ({args.batch_concurrency} lines)", *busy))
    print(f"batch lines finished during the second run: {done_during}")


if __name__ == "__main__":
    main()
