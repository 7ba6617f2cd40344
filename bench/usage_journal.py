"""What the gateway's durable usage journal costs per delivered token: one committed UPDATE in a SQLite WAL
file (`gateway/usage.py`), measured here on its own. `python -m bench.usage_journal [--tokens N]`."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from gateway.usage import UsageJournal


def microseconds_per_token(journal: UsageJournal, tokens: int) -> float:
    journal.track("exec_bench", [{"request_id": "exec_bench", "phase": "decode", "tokens": 1}], delivered=1)
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
