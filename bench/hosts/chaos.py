"""`python -m bench.chaos --hosts`: the chaos run across hosts. One load runs on the platform across
network namespaces (bench.hosts.fleet) while, one at a time and at random, a worker host is lost (every
process in its namespace SIGKILLed, then started again), a prefill-decode link is cut, or the gateway is
partitioned from the control plane; each undone after a random pause. Then the usage is drained and the
ledger reconciled with what the clients received, as in the chaos run on loopback."""

import asyncio
import random
import tempfile
import time
from pathlib import Path

from bench.chaos.database import read_ledger
from bench.chaos.drain import wait_for_usage_drained
from bench.chaos.ledger import reconcile
from bench.chaos.load import Load, LoadSettings
from bench.hosts.faults import FaultRecord, run_fault
from bench.hosts.fleet import DECODE_HOSTS, GATEWAY, PREFILL_HOSTS, HostsPlatform, multi_host_platform
from bench.hosts.run import DRAIN_TIMEOUT_S, FREED_TIMEOUT_S, blocks_held_after
from bench.progress import log


def random_fault(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    fault = rng.choice(["host-lost", "link-cut", "partition"])
    if fault == "host-lost":
        return fault, (rng.choice([*PREFILL_HOSTS, *DECODE_HOSTS]),)
    if fault == "link-cut":
        return fault, (rng.choice(PREFILL_HOSTS), rng.choice(DECODE_HOSTS))
    return fault, (GATEWAY,)


Range = tuple[float, float]


async def faults_during(
    platform: HostsPlatform, load: Load, rng: random.Random, end: float, interval_s: Range, down_s: Range
) -> list[FaultRecord]:
    """One fault at a time until `end` (a monotonic time); the load goes on while a fault lasts."""
    records: list[FaultRecord] = []
    while time.monotonic() + (pause := rng.uniform(*interval_s)) < end:
        await asyncio.sleep(pause)
        fault, target = random_fault(rng)
        load.until = float("inf")
        try:
            record = await asyncio.to_thread(run_fault, platform, fault, target, rng.uniform(*down_s), load.started)
            records.append(record)
        finally:
            load.until = max(end, time.monotonic() + 2.0)
    return records


async def chaos_across_hosts(platform: HostsPlatform, args) -> int:
    lengths = tuple(args.prompt_tokens), tuple(args.max_tokens)
    settings = LoadSettings(args.clients_per_org, *lengths, args.request_timeout)
    load = Load(platform.base_url, platform.api_keys, settings, args.seed)
    await load.warm_up(60.0)
    rng = random.Random(args.seed)
    end = time.monotonic() + args.duration
    running = asyncio.create_task(load.run(args.duration))
    records = await faults_during(platform, load, rng, end, tuple(args.kill_interval), tuple(args.down_time))
    await running
    drained = await asyncio.to_thread(wait_for_usage_drained, platform, DRAIN_TIMEOUT_S)
    ours = {r.request_id for r in load.records if r.request_id}
    events = [e for e in await asyncio.to_thread(read_ledger, platform.stack) if e.request_id in ours]
    held = await asyncio.to_thread(blocks_held_after, platform, FREED_TIMEOUT_S)
    r = reconcile(load.records, events)
    print("| fault | target | from s | to s |\n| --- | --- | --- | --- |")
    for record in records:
        print(f"| {record.fault} | {record.target} | {record.started_at_s:.1f} | {record.ended_at_s:.1f} |")
    print(
        f"\nrequests {r.requests_sent}, completed {r.completed}, failed {r.errors_by_code or 'none'}; "
        f"tokens delivered {r.delivered_tokens}, billed {r.billed_output_tokens}; lost {r.lost}, "
        f"doubled {r.doubled}, misattributed {r.misattributed}, overbilled {r.overbilled}; "
        f"usage drained {drained}; KV blocks held after {held}"
    )
    whole = r.delivered_tokens == r.billed_output_tokens and not r.failed and drained and not any(held.values())
    return 0 if whole else 1


def run_hosts(args) -> int:
    state_dir: Path = args.state_dir or Path(tempfile.mkdtemp(prefix="diptych-hosts-chaos-"))
    log(f"across hosts; state and logs under {state_dir}")
    with multi_host_platform(state_dir / "stack", f"sqlite:///{state_dir / 'controlplane.sqlite3'}") as platform:
        return asyncio.run(chaos_across_hosts(platform, args))
