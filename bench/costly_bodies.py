"""How much one tenant's costly request bodies stall another tenant's token stream, on a live colocated
platform (diptych-tiny, one colocated worker, the gateway and the control plane as their own processes).

A victim streams chat completions through the gateway's HTTP API, one after another, for the whole run. A
second client sends each kind of costly body (a 7.5 MB prompt, a recursive tool schema, hundreds of
thousands of small values, ...) a few times in a row. Every body is refused or answered by the gateway
beside the event loop that streams the victim's tokens: whatever it costs the loop, or takes of the CPU
from the loop and the worker, is a gap between the victim's tokens. It prints the victim's p99 and largest
inter-token gap while each kind is sent, and what each adds to the p99 of a clean run (goal: at most 0.1 s
added). The model's context in the catalog is 262,144 tokens unless told, so that the gateway tokenizes
prompts as long as any model takes (4 MiB) before refusing them as longer than the context.

    .venv/bin/python -m bench.costly_bodies [--rounds 5] [--max-tokens 48] [--context-length 262144]
"""

import argparse
import asyncio
import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.live_platform import start_platform
from bench.stats import percentile

MODEL = "diptych-tiny"
BODY_MB = 7.5


def _text(size: int) -> str:
    return ("the quick brown fox jumps over the lazy dog " * (size // 44 + 1))[:size]


def _tools(count: int) -> list[dict]:
    """`count` tools of about 60 KB of parameters each."""
    fields = {f"field_{i}": {"type": "string", "description": "d" * 16} for i in range(850)}
    schema = {"type": "object", "properties": fields}
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}} for i in range(count)]


def costly_bodies() -> dict[str, tuple[str, bytes]]:
    """kind -> (path, body), built once before anything is measured. The 4 MiB prompts are as long as any
    model takes (validation.MAX_PROMPT_BYTES); the 7.5 MB ones are refused by their size alone."""
    size, most = int(BODY_MB * 1e6), 4 << 20
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bodies = {
        f"{BODY_MB} MB prompt of one word": ("completions", {"model": MODEL, "prompt": "a" * size}),
        f"{BODY_MB} MB prompt of text": ("completions", {"model": MODEL, "prompt": _text(size)}),
        "4 MiB prompt of one word": ("completions", {"model": MODEL, "prompt": "a" * most}),
        "4 MiB prompt of text": ("completions", {"model": MODEL, "prompt": _text(most)}),
        "4 MiB chat message": ("chat/completions", {**chat, "messages": [{"role": "user", "content": _text(most)}]}),
        "8 tools of 60 KB schemas": ("chat/completions", {**chat, "tools": _tools(8)}),
        "recursive $ref tool schema": ("chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}),
        "250k empty content parts": (
            "chat/completions",
            {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 250_000}]},
        ),
        "400k logit_bias entries": (
            "completions",
            {"model": MODEL, "prompt": "a", "logit_bias": {str(i): 1 for i in range(400_000)}},
        ),
        "900k stop strings": ("completions", {"model": MODEL, "prompt": "a", "stop": [""] * 900_000}),
    }
    return {kind: (path, json.dumps(body).encode()) for kind, (path, body) in bodies.items()}


class Victim:
    """Streams chat completions back to back on its own event loop (a thread of its own), recording the
    gaps between the token chunks of each stream with the time each gap ended."""

    def __init__(self, base_url: str, api_key: str, max_tokens: int) -> None:
        self._base_url = base_url
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._max_tokens = max_tokens
        self.gaps: list[tuple[float, float]] = []  # (ended at, seconds)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def gaps_between(self, start: float, end: float) -> list[float]:
        """The gaps that overlap [start, end]: a stall that began before a request was answered counts."""
        return [gap for ended, gap in list(self.gaps) if ended >= start and ended - gap <= end]

    async def _run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "max_tokens": self._max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with httpx.AsyncClient(base_url=self._base_url, headers=self._headers, timeout=60) as client:
            while not self._stop.is_set():
                try:
                    await self._stream(client, body)
                except httpx.HTTPError:
                    self.errors += 1

    async def _stream(self, client: httpx.AsyncClient, body: dict) -> None:
        last = None
        async with client.stream("POST", "/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    self.gaps.append((now, now - last))
                last = now


def send_costly(base_url: str, api_key: str, path: str, body: bytes, rounds: int) -> tuple[float, float, list[int]]:
    """Sends `body` `rounds` times in a row; (started, ended, the statuses)."""
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    statuses = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        started = time.perf_counter()
        for _ in range(rounds):
            statuses.append(client.post(f"/{path}", content=body).status_code)
        return started, time.perf_counter(), statuses


@dataclass
class Row:
    kind: str
    gaps: list[float]  # the victim's, while the kind was sent
    statuses: list[int]  # the costly requests' answers (none for the clean run)


def measure(base_url: str, api_key: str, rounds: int, max_tokens: int, clean_s: float) -> list[Row]:
    bodies = costly_bodies()
    victim = Victim(base_url, api_key, max_tokens)
    victim.start()
    try:
        time.sleep(3.0)  # the victim's first streams warm the path up; not measured
        started = time.perf_counter()
        time.sleep(clean_s)  # the clean run: the victim streams alone
        rows = [Row("clean run", victim.gaps_between(started, time.perf_counter()), [])]
        for kind, (path, body) in bodies.items():
            start, end, statuses = send_costly(base_url, api_key, path, body, rounds)
            rows.append(Row(kind, victim.gaps_between(start, end), statuses))
    finally:
        victim.stop()
    if victim.errors:
        print(f"# the victim's streams failed {victim.errors} times")
    return rows


def report(rows: list[Row], rounds: int) -> None:
    clean_p99 = percentile(rows[0].gaps, 99)
    print(f"\nthe victim's inter-token gaps while each body is sent {rounds} times in a row; seconds")
    print(f"{'body':<32}{'gaps':>7}{'p99':>9}{'max':>9}{'p99 added':>11}  statuses")
    for row in rows:
        p99 = percentile(row.gaps, 99)
        added = f"{p99 - clean_p99:>11.3f}" if row.statuses else f"{'':>11}"
        shown = ",".join(sorted({str(s) for s in row.statuses}))
        largest = max(row.gaps, default=float("nan"))
        print(f"{row.kind:<32}{len(row.gaps):>7}{p99:>9.3f}{largest:>9.3f}{added}  {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="how many times each costly body is sent")
    parser.add_argument("--max-tokens", type=int, default=48, help="the length of each of the victim's streams")
    parser.add_argument("--clean-seconds", type=float, default=10.0, help="how long the clean run lasts")
    parser.add_argument(
        "--context-length", type=int, default=262_144, help="the model's context in the catalog (the gateway's limits)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="diptych-costly-bench-") as directory:
        log = lambda message: print(f"# {message}")  # noqa: E731
        platform = start_platform(Path(directory), MODEL, args.context_length, 1, 1, log)
        try:
            with platform.serving("colocated"):
                base_url = platform.http_urls["colocated"]
                rows = measure(base_url, platform.api_key, args.rounds, args.max_tokens, args.clean_seconds)
        finally:
            platform.stop()
    report(rows, args.rounds)


if __name__ == "__main__":
    main()
