"""Faults across hosts under load, each judged by every request's outcome and the usage ledger:

    .venv/bin/python -m bench.hosts.run [--faults link-cut host-lost partition] [--partition-s 30]

The platform runs across five namespaces (bench.hosts.fleet). For each fault a fresh load of streaming
clients (bench.chaos.load) runs, the fault is made a moment into it and undone after its duration, the
load goes on a little after; then the gateway's usage is drained into the ledger (bench.chaos.drain) and
this load's requests reconciled against it (bench.chaos.ledger): delivered = billed, nothing lost,
doubled or misattributed, and no KV block left held on any worker. A markdown table is printed.
"""

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from bench.chaos.database import read_ledger
from bench.chaos.drain import wait_for_usage_drained
from bench.chaos.ledger import Reconciliation, reconcile
from bench.chaos.load import Load, LoadSettings
from bench.hosts.faults import FAULTS, FaultRecord, run_fault
from bench.hosts.fleet import DECODE_HOSTS, PREFILL_HOSTS, HostsPlatform, multi_host_platform
from bench.progress import log

LOAD = LoadSettings(clients_per_organization=3, prompt_tokens=(48, 200), max_tokens=(24, 64), request_timeout_s=60.0)
FAULT_AFTER_S = 2.0  # into the load
TAIL_S = 4.0  # the load goes on this long after the fault is undone
DRAIN_TIMEOUT_S = 90.0
RETRIES, MIGRATIONS = "diptych_gateway_retries_total", "diptych_gateway_decode_migrations_total"
FREED_TIMEOUT_S = 15.0
TARGETS = {
    "link-cut": (PREFILL_HOSTS[0], DECODE_HOSTS[0]),
    "host-lost": (DECODE_HOSTS[0],),
    "partition": ("gateway",),
}


@dataclasses.dataclass
class FaultOutcome:
    fault: FaultRecord
    reconciliation: Reconciliation
    error_messages: dict[str, int]
    drained: bool
    kv_blocks_held: dict[str, int]  # after the load, by worker: all zero when every transfer was freed
    completed_while_down: int  # requests sent while the fault lasted that completed
    served_late: int  # requests sent in the fault's second half that completed before it was undone
    retries: float  # worker calls the gateway retried elsewhere during the load
    migrations: float  # streams it moved to another decode worker mid-way

    @property
    def passed(self) -> bool:
        r = self.reconciliation
        whole = r.delivered_tokens == r.billed_output_tokens and not r.failed
        return whole and self.drained and not any(self.kv_blocks_held.values())


async def fault_under_load(
    platform: HostsPlatform,
    fault: str,
    down_s: float,
    seed: int,
    restart: bool = True,
    target: tuple[str, ...] | None = None,
) -> FaultOutcome:
    """One load with the fault made in it; `restart`: a lost host comes back (else it stays down, and the
    platform serves on without it); `target`: the hosts it strikes (default: TARGETS[fault])."""
    target = target or TARGETS[fault]
    load = Load(platform.base_url, platform.api_keys, LOAD, seed)
    await load.warm_up(60.0)
    retries, migrations = platform.gateway_metric(RETRIES), platform.gateway_metric(MIGRATIONS)
    running = asyncio.create_task(load.run(FAULT_AFTER_S + down_s + TAIL_S))
    await asyncio.sleep(FAULT_AFTER_S)
    record = await asyncio.to_thread(run_fault, platform, fault, target, down_s, load.started, restart)
    if fault == "host-lost" and not restart:
        platform.workers.pop(target[0], None)  # gone for good: no load report to read (a worker's)
    load.until = max(load.until, time.monotonic() + TAIL_S)
    await running
    drained = await asyncio.to_thread(wait_for_usage_drained, platform, DRAIN_TIMEOUT_S)
    ours = {r.request_id for r in load.records if r.request_id}
    events = [e for e in await asyncio.to_thread(read_ledger, platform.stack) if e.request_id in ours]
    held = await asyncio.to_thread(blocks_held_after, platform, FREED_TIMEOUT_S)
    while_down = sum(r.completed and record.started_at_s <= r.sent_at_s < record.ended_at_s for r in load.records)
    late = (record.started_at_s + record.ended_at_s) / 2
    served_late = sum(r.completed and late <= r.sent_at_s and r.ended_at_s < record.ended_at_s for r in load.records)
    return FaultOutcome(
        record,
        reconcile(load.records, events),
        dict(load.error_messages),
        drained,
        held,
        while_down,
        served_late,
        platform.gateway_metric(RETRIES) - retries,
        platform.gateway_metric(MIGRATIONS) - migrations,
    )


def blocks_held_after(platform: HostsPlatform, timeout_s: float) -> dict[str, int]:
    """KV blocks by worker, once none holds any or `timeout_s` passed (a worker frees an abandoned
    transfer's blocks when its timeouts run out, not at once)."""
    deadline = time.monotonic() + timeout_s
    while any((held := platform.kv_blocks_in_use()).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return held


def table(outcomes: list[FaultOutcome]) -> str:
    lines = [
        "| fault | target | down s | sent | completed | completed while down | sent late, done while down | "
        "failed (code: requests) | "
        "retried | migrated | usage spooled | delivered | billed | lost | doubled | misattributed | "
        "KV blocks held after | verdict |",
        "|" + " --- |" * 18,
    ]
    for o in outcomes:
        r = o.reconciliation
        errors = ", ".join(f"{code}: {count}" for code, count in r.errors_by_code.items()) or "none"
        down = o.fault.ended_at_s - o.fault.started_at_s
        held = sum(o.kv_blocks_held.values())
        verdict = "pass" if o.passed else "FAIL"
        lines.append(
            f"| {o.fault.fault} | {o.fault.target} | {down:.0f} | {r.requests_sent} | {r.completed} | "
            f"{o.completed_while_down} | {o.served_late} | {errors} | {o.retries:.0f} | {o.migrations:.0f} | "
            f"{o.fault.peak_spooled:.0f} | "
            f"{r.delivered_tokens} | {r.billed_output_tokens} | {r.lost} | {r.doubled} | {r.misattributed} | "
            f"{held} | {verdict} |"
        )
    return "\n".join(lines)


def error_lines(outcomes: list[FaultOutcome]) -> str:
    return "\n".join(
        f"- {o.fault.fault}: {count} × {message}" for o in outcomes for message, count in o.error_messages.items()
    )


async def run_faults(platform: HostsPlatform, faults: list[str], down_s: dict[str, float], seed: int):
    outcomes = []
    for index, fault in enumerate(faults):
        outcomes.append(await fault_under_load(platform, fault, down_s[fault], seed + index))
        verdict = "pass" if outcomes[-1].passed else "FAIL"
        log(f"{fault}: {verdict}\n{table(outcomes[-1:])}\n{error_lines(outcomes[-1:])}")
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--down-s", type=float, default=6.0, help="how long a link cut or a lost host lasts")
    parser.add_argument("--partition-s", type=float, default=30.0, help="how long the gateway is partitioned")
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--state-dir", type=Path, help="default: a fresh temporary directory")
    args = parser.parse_args()
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="diptych-hosts-"))
    durations = {"link-cut": args.down_s, "host-lost": args.down_s, "partition": args.partition_s}
    log(f"state and logs under {state_dir}")
    with multi_host_platform(state_dir / "stack", f"sqlite:///{state_dir / 'controlplane.sqlite3'}") as platform:
        outcomes = asyncio.run(run_faults(platform, args.faults, durations, args.seed))
        for name in platform.workers:  # the path matrix, as far as the workers tell it
            log(f"{name} moved KV bytes by path: {platform.kv_bytes_by_path(name)}")
    print(table(outcomes))
    print(error_lines(outcomes))
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
