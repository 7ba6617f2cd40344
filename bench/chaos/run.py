"""One chaos run from start to verdict: the platform started, the load and the batches sent while the
killer works, every batch ended and the usage drained, the ledger read and compared, everything stopped,
the report printed. `main` is `python -m bench.chaos`."""

import asyncio
import dataclasses
import json
import logging
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.chaos import batch_files
from bench.chaos.batch_load import BatchSettings, BatchTraffic
from bench.chaos.database import read_ledger, read_runner_keys
from bench.chaos.drain import wait_for_usage_drained
from bench.chaos.faults import Chaos, ChaosSettings
from bench.chaos.harness import JOBS, READY_TIMEOUT_S, ChaosPlatform, start_platform
from bench.chaos.load import Load, LoadSettings
from bench.chaos.options import parse_args
from bench.chaos.report import TOP_ERROR_MESSAGES, build_report, render
from bench.progress import log


async def report_progress(load: Load, chaos: Chaos, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        records = load.records
        log(
            f"load: {len(records)} sent, {sum(r.completed for r in records)} completed, "
            f"{sum(bool(r.error) for r in records)} errored, {sum(r.delivered_tokens for r in records)} tokens; "
            f"{len(chaos.kills)} kill(s)"
        )


async def run_load_under_chaos(platform: ChaosPlatform, args) -> tuple[Load, Chaos, BatchTraffic | None]:
    load = Load(
        platform.base_url,
        platform.api_keys,
        LoadSettings(args.clients_per_org, tuple(args.prompt_tokens), tuple(args.max_tokens), args.request_timeout),
        args.seed,
    )
    chaos = Chaos(
        platform,
        ChaosSettings(tuple(args.victims), tuple(args.kill_interval), tuple(args.down_time), args.max_kills),
        args.seed,
    )
    log("warming up: one completed request per organization")
    await load.warm_up(READY_TIMEOUT_S)
    log(
        f"load for {args.duration:g} s: {args.clients_per_org} streaming client(s) per organization; "
        f"victims {', '.join(args.victims)}"
    )
    traffic = batch_traffic(platform, args) if args.batches else None
    progress = asyncio.create_task(report_progress(load, chaos, args.progress_every))
    load_task = asyncio.create_task(load.run(args.duration))
    await asyncio.sleep(0)  # lets the load stamp its start before the chaos reads it
    tasks = [load_task, chaos.run(load, args.duration, args.tail)]
    if traffic is not None:
        tasks.append(traffic.run(lambda: time.monotonic() < load.until))
    try:
        await asyncio.gather(*tasks)
    finally:
        progress.cancel()
    log("load stopped; every victim is back")
    if traffic is not None:
        cancelled = sum(bool(b.cancel) for b in traffic.submitted)
        log(
            f"{len(traffic.submitted)} batch(es) submitted, {cancelled} cancelled; "
            f"calls retried: {dict(traffic.retried_calls)}"
        )
    for message, count in load.error_messages.most_common(TOP_ERROR_MESSAGES):
        log(f"{count} x {message}")
    chaos.exited_by_themselves += await asyncio.to_thread(platform.revive_exited)
    return load, chaos, traffic


def batch_traffic(platform: ChaosPlatform, args) -> BatchTraffic:
    settings = BatchSettings(
        tuple(args.batch_every),
        tuple(args.batch_lines),
        tuple(args.batch_max_tokens),
        args.cancel_share,
        (1.0, 6.0),
    )
    log(
        f"and a batch of {args.batch_lines[0]}-{args.batch_lines[1]} lines per organization every "
        f"{args.batch_every[0]:g}-{args.batch_every[1]:g} s"
    )
    return BatchTraffic(platform.gateway_http_url, platform.api_keys, settings, args.seed)


def run(args) -> int:
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="diptych-chaos-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    keep_state = args.state_dir is not None
    platform = start_platform(
        state_dir,
        args.prefill_workers,
        args.decode_workers,
        args.batches or JOBS in args.victims,
        args.kv_path,
        args.gateways,
    )
    try:
        load, chaos, traffic = asyncio.run(run_load_under_chaos(platform, args))
        if traffic is not None:
            log(f"waiting up to {args.batch_timeout:g} s for every batch to end")
            unended = batch_files.wait_until_ended(
                platform.stack.control_plane_url, platform.api_keys, args.batch_timeout
            )
            log(f"batches still running: {', '.join(unended)}" if unended else "every batch has ended")
        log(f"waiting up to {args.drain_timeout:g} s for the gateway's usage to reach the ledger")
        drained = wait_for_usage_drained(platform, args.drain_timeout)
        log("reading the ledger" + (" and every batch's files" if traffic is not None else ""))
        events = read_ledger(platform.stack)
        batches = None
        if traffic is not None:
            runner_keys = read_runner_keys(platform.stack)
            batches = batch_files.collect(platform.stack.control_plane_url, platform.api_keys, runner_keys)
        report = build_report(args, load, chaos, drained, events, traffic, batches)
    except BaseException:
        keep_state = True
        raise
    finally:
        log("stopping every process")
        platform.stop()
        if keep_state:
            log(f"logs and databases kept in {state_dir}")
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
    print(render(report), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=1))
        log(f"results written to {args.json}")
    return 1 if report.failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Every retry the clients' SDK makes, with the error that caused it, on stderr: a request that failed
    # after its retries is then explained try by try.
    sdk_log = logging.getLogger("diptych")
    sdk_log.setLevel(logging.INFO)
    sdk_log.addHandler(logging.StreamHandler(sys.stderr))
    # SIGTERM ends the run as Ctrl-C does: through the `finally` that stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.hosts:
        from bench.hosts.chaos import run_hosts  # namespaces and links: only this mode needs them

        return run_hosts(args)
    return run(args)
