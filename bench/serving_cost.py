"""Host CPU spent per output token by each serving process: `python -m bench.serving_cost`.

Starts the platform (control plane, then one mode at a time: its workers and its gateway), replays one
closed-loop workload through the gateway's gRPC API and reads every process's CPU time (user + system,
from /proc) before and after. CPU milliseconds per output token, split by process, say where the serving
path's host work goes; unlike tok/s they hardly move when other work shares the machine's cores, so two
commits can be compared on a busy machine. tok/s is printed too, for a quiet machine.
"""

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.gateway_client import GatewayClient
from bench.live_platform import MODES, LivePlatform, start_platform
from bench.progress import log
from bench.workload import WorkloadSpec, make_requests

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class ModeCost:
    mode: str
    output_tokens: int
    wall_s: float
    cpu_s: dict[str, float]  # process name -> CPU seconds during the run

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def cpu_ms_per_token(self, name: str) -> float:
        return 1000.0 * self.cpu_s[name] / self.output_tokens


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    user, system = int(fields[11]), int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return (user + system) / CLOCK_TICKS


def measure_mode(platform: LivePlatform, mode: str, args: argparse.Namespace) -> ModeCost:
    spec = WorkloadSpec(
        requests=args.requests,
        prompt_tokens_mean=args.prompt_tokens,
        prompt_tokens_min=args.prompt_tokens,
        prompt_tokens_max=args.prompt_tokens,
        output_tokens_min=args.output_tokens,
        output_tokens_max=args.output_tokens,
        shared_prefix_share=0.0,
        shared_prefix_tokens=0,
        vocab_size=512,
        seed=7,
    )
    requests = make_requests(spec)
    with platform.serving(mode) as address:
        client = GatewayClient(
            address, platform.api_key, platform.model, args.temperature, idempotency_keys=args.idempotency_keys
        )
        asyncio.run(_replay(client, requests[: args.concurrency], args.concurrency))  # warm-up
        pids = {name: process.pid for name, process in platform.stack.processes.items()}
        before = {name: process_cpu_s(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        results = asyncio.run(_replay(client, requests, args.concurrency))
        wall_s = time.perf_counter() - started
        after = {name: process_cpu_s(pid) for name, pid in pids.items()}
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed in {mode} mode, first: {failed[0]}")
    tokens = sum(len(r.token_ids) for r in results)
    return ModeCost(mode, tokens, wall_s, {name: after[name] - before[name] for name in pids})


async def _replay(client: GatewayClient, requests, concurrency: int):
    async with client:
        return await client.replay_closed_loop(requests, concurrency)


def render(costs: list[ModeCost]) -> str:
    lines = ["mode        tok/s   CPU ms per output token, by process"]
    for cost in costs:
        shares = ", ".join(
            f"{name} {cost.cpu_ms_per_token(name):.3f}" for name in sorted(cost.cpu_s) if cost.cpu_s[name] > 0
        )
        total = sum(cost.cpu_s.values()) * 1000.0 / cost.output_tokens
        lines.append(f"{cost.mode:<10} {cost.tokens_per_s:6.0f}   total {total:.3f}: {shares}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-tiny")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else every request samples at it")
    parser.add_argument(
        "--idempotency-keys", action="store_true", help="each request with a key of its own, as the SDK sends them"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="diptych-cost-") as scratch:
        platform = start_platform(Path(scratch), args.model, 1024, args.threads, args.threads, log)
        try:
            costs = [measure_mode(platform, mode, args) for mode in args.modes]
        finally:
            platform.stop()
    print(render(costs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
