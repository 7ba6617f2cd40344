"""What the gateway's durable usage journal costs per delivered token: one store into its memory-mapped
counts file (`gateway/accounts/usage.py`), measured here on its own. `python -m bench.usage_journal [--tokens N]`."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from diptych_common.internal_api.messages import UsageEvent
from gateway.accounts.usage import UsageJournal

EVENT = UsageEvent(
    request_id="exec_bench",
    client_request_id="",
    phase="decode",
    organization_id="org",
    api_key_id="key",
    model="diptych-tiny",
    region="",
    worker_id="decode-0",
    tokens=1,
    cached_tokens=0,
    kv_bytes=0,
    compute_ms=0,
    started_at="2030-01-01T00:00:00+00:00",
    finished_at="2030-01-01T00:00:00+00:00",
)


def microseconds_per_token(journal: UsageJournal, tokens: int) -> float:
    journal.track("exec_bench", [EVENT], delivered=1)
    started = time.perf_counter()
    for delivered in range(2, tokens + 2):
        journal.count_delivered("exec_bench", delivered)
    elapsed = time.perf_counter() - started
    journal.finish("exec_bench", [])
    return elapsed / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=5000, help="tokens counted per run")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        journal = UsageJournal(Path(directory) / "journal.sqlite3")
        runs = []
        for run in range(args.runs):
            runs.append(microseconds_per_token(journal, args.tokens))
            print(f"run {run + 1}/{args.runs}: {runs[-1]:.1f} µs per token", flush=True)
        journal.close()
    print(f"median: {statistics.median(runs):.1f} µs per delivered token ({args.tokens} tokens a run)")


if __name__ == "__main__":
    main()
