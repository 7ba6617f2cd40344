"""How fast the shared KV tier serves a prompt's blocks across the link, against computing them:

    .venv/bin/python -m bench.hosts.kv_tier [--prefix-tokens 128 256 512 960] [--repeats 3]

The platform runs across hosts with the tier's store on a host of its own (bench.hosts.fleet, kv_tier=True).
Each prefix (of each size, `repeats` of them) is sent once while both prefill hosts serve; the first host
computes it and puts its blocks to the store. That host is then stopped, and each prefix is sent again with
a new tail of TAIL_TOKENS: it lands on the other prefill host, which loads the prefix from the store across
the link; beside it a fresh prompt of the same length, computed there in full. The table compares their
TTFT (the gateway's) and the prefill phase's compute time, with the bytes the store's host sent.
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import diptych
from bench.hosts.fleet import KV_TIER_HOST, PREFILL_HOSTS, HostsPlatform, multi_host_platform
from bench.hosts.launch import KV_TIER_PORT
from bench.hosts.network import INNER_LINK, ip
from bench.progress import log
from diptych.types import PhaseUsage

BLOCK_SIZE = 16  # the workers' default
# Past the gateway's --skip-split-below (32): the decode worker that served a prefix holds it, and a
# prompt differing from it by fewer tokens would run there whole, with no prefill host at all.
TAIL_TOKENS = 48
MAX_TOKENS = 8
TTFT_SUM = "diptych_gateway_time_to_first_token_seconds_sum"
STOPPED_TIMEOUT_S = 15.0
PUT_TIMEOUT_S = 15.0


def tier_link_bytes(platform: HostsPlatform) -> tuple[int, int]:
    """(received, sent) bytes of the store host's link: what crossed it to and from the store."""
    namespace = platform.network.hosts[KV_TIER_HOST].namespace
    (link,) = json.loads(ip("-n", namespace, "-j", "-s", "link", "show", INNER_LINK).stdout)
    return link["stats64"]["rx"]["bytes"], link["stats64"]["tx"]["bytes"]


def tier_sockets(platform: HostsPlatform, state: str) -> list[tuple[str, str]]:
    """(local, peer) address of each TCP socket of the store's port in its host's namespace, in `state`
    (`ss`'s: listening, established)."""
    namespace = platform.network.hosts[KV_TIER_HOST].namespace
    listed = ip("netns", "exec", namespace, "ss", "-Htn", "state", state, f"( sport = :{KV_TIER_PORT} )").stdout
    columns = [line.split() for line in listed.splitlines() if line.strip()]
    return [(ipv4_of(c[-2]), ipv4_of(c[-1])) for c in columns]


def ipv4_of(endpoint: str) -> str:
    """The address of `ss`'s ADDRESS:PORT; gRPC's sockets are IPv6 ones, holding IPv4 as [::ffff:a.b.c.d]."""
    return endpoint.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")


def tier_summary(platform: HostsPlatform, name: str):
    """A worker's KV tier totals (KvTierSummary) and the prompt tokens it computed, from its load report."""
    load = platform.stack.worker_load(platform.workers[name]["address"])
    return load.kv_tier, load.prompt_tokens_computed


def wait_for_puts(platform: HostsPlatform, name: str, blocks: int) -> int:
    """Until the worker shipped `blocks` blocks to the store in all (or PUT_TIMEOUT_S); returns how many."""
    deadline = time.monotonic() + PUT_TIMEOUT_S
    while (put := tier_summary(platform, name)[0].blocks_put) < blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    return put


def stop_worker(platform: HostsPlatform, name: str) -> None:
    """Stops the worker (it drains and says so) and waits until the registry no longer lists it ready."""
    worker_id = platform.workers.pop(name)["id"]
    platform.stack.stop_process(name)
    deadline = time.monotonic() + STOPPED_TIMEOUT_S
    while time.monotonic() < deadline:
        entries = platform.stack.registry().json()["workers"]
        if not any(e["id"] == worker_id and e["state"] == "ready" for e in entries):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the registry still lists {name} ready {STOPPED_TIMEOUT_S:.0f} s after it was stopped")


def timed(platform: HostsPlatform, client: diptych.Client, prompt: list[int]) -> tuple[diptych.Completion, float]:
    """The greedy completion and its TTFT as the gateway measured it (one request at a time)."""
    before = platform.gateway_metric(TTFT_SUM)
    completion = client.completions.create(model="diptych-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return completion, platform.gateway_metric(TTFT_SUM) - before


def prefill_of(completion: diptych.Completion) -> PhaseUsage:
    """The prefill phase's usage; every request here runs split (its prompt is past --skip-split-below)."""
    if completion.usage.prefill is None:
        raise RuntimeError(f"request {completion.id} reports no prefill phase: it did not run split")
    return completion.usage.prefill


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(count)]


@dataclass
class Row:
    prefix_tokens: int
    samples: int  # prefixes the first host computed and the other loaded
    loaded_ttft_ms: float  # medians
    computed_ttft_ms: float
    loaded_prefill_ms: float
    computed_prefill_ms: float
    cached_tokens: int  # the loaded requests' cached tokens (each)
    mb_sent: float  # by the store's host, per loaded request


def measure(platform: HostsPlatform, sizes: list[int], repeats: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    names = {entry["id"]: name for name, entry in platform.workers.items()}
    prefixes = {size: [tokens(rng, size) for _ in range(repeats)] for size in sizes}
    with diptych.Client(api_key=platform.credentials.api_key, base_url=platform.base_url) as client:
        computed_on: dict[tuple[int, int], str] = {}
        for size, group in prefixes.items():
            for index, prefix in enumerate(group):
                completion, _ = timed(platform, client, prefix + tokens(rng, 1))
                computed_on[size, index] = names[prefill_of(completion).worker_id]
        hosts = list(computed_on.values())
        computer = max(PREFILL_HOSTS, key=hosts.count)  # one at a time, the gateway sends them all to one
        wait_for_puts(
            platform, computer, sum(size // BLOCK_SIZE for (size, _), h in computed_on.items() if h == computer)
        )
        log(f"{computer} computed {hosts.count(computer)} of {len(hosts)} prefixes; stopping it")
        stop_worker(platform, computer)
        return [
            row_for(platform, client, size, [p for i, p in enumerate(group) if computed_on[size, i] == computer], rng)
            for size, group in prefixes.items()
        ]


def row_for(
    platform: HostsPlatform, client: diptych.Client, size: int, prefixes: list[list[int]], rng: random.Random
) -> Row:
    loaded, computed, sent = [], [], []
    for prefix in prefixes:
        _, before = tier_link_bytes(platform)
        loaded.append(timed(platform, client, prefix + tokens(rng, TAIL_TOKENS)))
        sent.append(tier_link_bytes(platform)[1] - before)
        computed.append(timed(platform, client, tokens(rng, size + TAIL_TOKENS)))
    cached = {prefill_of(completion).cached_tokens for completion, _ in loaded}

    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1000 if values else float("nan")

    return Row(
        size,
        len(prefixes),
        median_ms([ttft for _, ttft in loaded]),
        median_ms([ttft for _, ttft in computed]),
        median_ms([prefill_of(c).compute_ms / 1000 for c, _ in loaded]),
        median_ms([prefill_of(c).compute_ms / 1000 for c, _ in computed]),
        min(cached) if len(cached) == 1 else -1,  # -1: the loaded requests disagree
        statistics.median(sent) / 1e6 if sent else 0.0,
    )


def table(rows: list[Row]) -> str:
    lines = [
        f"| prefix tokens (+{TAIL_TOKENS}) | samples | cached tokens | store host sent MB | TTFT loaded ms | "
        "TTFT computed ms | prefill loaded ms | prefill computed ms |",
        "|" + " --- |" * 8,
    ]
    for r in rows:
        lines.append(
            f"| {r.prefix_tokens} | {r.samples} | {r.cached_tokens} | {r.mb_sent:.2f} | {r.loaded_ttft_ms:.0f} | "
            f"{r.computed_ttft_ms:.0f} | {r.loaded_prefill_ms:.0f} | {r.computed_prefill_ms:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hosts.kv_tier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[128, 256, 512, 960])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if any(size % BLOCK_SIZE or size <= 0 for size in args.prefix_tokens):
        parser.error(f"each --prefix-tokens must be a positive multiple of the block size, {BLOCK_SIZE}")
    with tempfile.TemporaryDirectory(prefix="diptych-kv-tier-") as state:
        database = f"sqlite:///{Path(state) / 'controlplane.sqlite3'}"
        with multi_host_platform(Path(state) / "stack", database, kv_tier=True) as platform:
            rows = measure(platform, args.prefix_tokens, args.repeats, args.seed)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
