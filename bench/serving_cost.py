"""Host CPU spent per output token by each serving process: `python -m bench.serving_cost`.

Starts the platform (control plane, then one mode at a time: its workers and its gateway), replays one
closed-loop workload through the gateway's gRPC API and reads every process's CPU time (user + system,
from /proc) before and after. CPU milliseconds per output token, split by process, say where the serving
path's host work goes; unlike tok/s they hardly move when other work shares the machine's cores, so two
commits can be compared on a busy machine. tok/s is printed too, for a quiet machine.

`--beside CHECKOUT` runs a second gateway, from another checkout of the repository (another commit's code),
beside this one's over the same workers: the workload is dealt out in rounds that alternate between the two
gateways, each request to one of them, so both meet the same workers and the same load on the machine, and
each gateway's figures (its own CPU, and the workers' during its rounds) are those of its rounds.
"""

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.gateway_client import GatewayClient
from bench.live_platform import MODES, LivePlatform, start_platform
from bench.progress import log
from bench.workload import WorkloadSpec, make_requests
from diptych_server.stack import free_port

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


def workload(args: argparse.Namespace, requests: int, seed: int) -> list:
    spec = WorkloadSpec(
        requests=requests,
        prompt_tokens_mean=args.prompt_tokens,
        prompt_tokens_min=args.prompt_tokens,
        prompt_tokens_max=args.prompt_tokens,
        output_tokens_min=args.output_tokens,
        output_tokens_max=args.output_tokens,
        shared_prefix_share=0.0,
        shared_prefix_tokens=0,
        vocab_size=512,
        seed=seed,
    )
    return make_requests(spec)


def measure_mode(platform: LivePlatform, mode: str, args: argparse.Namespace) -> ModeCost:
    requests = workload(args, args.requests, seed=7)
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
    return ModeCost(mode, _tokens(results, mode), wall_s, {name: after[name] - before[name] for name in pids})


def measure_beside(platform: LivePlatform, mode: str, args: argparse.Namespace) -> list[ModeCost]:
    """This checkout's gateway and `args.beside`'s over the same workers, in alternating rounds; each
    request (warm-ups too) goes to one gateway only, so no prompt is cached for the other."""
    names = (f"gateway-{mode}", f"gateway-{mode}-beside")
    requests = workload(args, 2 * (args.requests + args.concurrency), seed=7)
    warm_ups, rounds = requests[: 2 * args.concurrency], requests[2 * args.concurrency :]
    costs = {
        name: ModeCost(f"{mode}, {label}", 0, 0.0, {}) for name, label in zip(names, ("this", "beside"), strict=True)
    }
    with platform.serving(mode) as address:
        addresses = {names[0]: address, names[1]: _start_beside(platform, names[1], mode, args.beside)}
        try:
            _alternate(platform, mode, args, names, addresses, warm_ups, rounds, costs)
        finally:
            platform.stack.stop_process(names[1])
    return [costs[name] for name in names]


def _alternate(
    platform: LivePlatform,
    mode: str,
    args: argparse.Namespace,
    names: tuple[str, str],
    addresses: dict[str, str],
    warm_ups: list,
    rounds: list,
    costs: dict[str, ModeCost],
) -> None:
    """Warms each gateway up, then sends each round's requests to one gateway after the other, adding
    each one's tokens, time and CPU (its own, and the workers') to its cost."""
    clients = {
        name: GatewayClient(at, platform.api_key, platform.model, args.temperature, args.idempotency_keys)
        for name, at in addresses.items()
    }
    for index, name in enumerate(names):
        asyncio.run(_replay(clients[name], warm_ups[index::2], args.concurrency))
    workers = {n: p.pid for n, p in platform.stack.processes.items() if not n.startswith("gateway-")}
    per_round = -(-args.requests // args.rounds)
    for round_index in range(args.rounds):
        chunk = rounds[2 * round_index * per_round : 2 * (round_index + 1) * per_round]
        for index, name in enumerate(names):
            pids = workers | {name: platform.stack.processes[name].pid}
            before = {n: process_cpu_s(pid) for n, pid in pids.items()}
            started = time.perf_counter()
            results = asyncio.run(_replay(clients[name], chunk[index::2], args.concurrency))
            costs[name].wall_s += time.perf_counter() - started
            costs[name].output_tokens += _tokens(results, mode)
            for n, pid in pids.items():
                key = "gateway" if n == name else n
                costs[name].cpu_s[key] = costs[name].cpu_s.get(key, 0.0) + process_cpu_s(pid) - before[n]


def _start_beside(platform: LivePlatform, name: str, mode: str, checkout: Path) -> str:
    """The other checkout's gateway, started as the stack starts its own (its own code first on the path)."""
    stack, port = platform.stack, free_port()
    args = ["gateway", "--port", str(port), "--http-port", str(free_port()), "--metrics-port", str(free_port())]
    with open(stack.log_path(name), "ab") as log:
        stack.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "diptych_server.cli", *args, "--mode", mode],
            cwd=checkout,
            env=stack.env(PYTHONPATH=f"{checkout / 'platform'}:{checkout}"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return f"127.0.0.1:{port}"
            except grpc.RpcError:
                time.sleep(0.2)
    raise RuntimeError(f"the gateway of {checkout} did not start; see {stack.log_path(name)}")


def _tokens(results, mode: str) -> int:
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed in {mode} mode, first: {failed[0]}")
    return sum(len(r.token_ids) for r in results)


async def _replay(client: GatewayClient, requests, concurrency: int):
    async with client:
        return await client.replay_closed_loop(requests, concurrency)


def render(costs: list[ModeCost]) -> str:
    lines = ["mode        tok/s   CPU ms per output token, by process"]
    for cost in costs:  # a mode beside another gateway is named "MODE, this" or "MODE, beside"
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
    parser.add_argument(
        "--beside", type=Path, help="a checkout whose gateway serves beside this one's, over the same workers"
    )
    parser.add_argument("--rounds", type=int, default=4, help="with --beside: rounds per gateway, alternating")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="diptych-cost-") as scratch:
        platform = start_platform(Path(scratch), args.model, 1024, args.threads, args.threads, log)
        try:
            if args.beside is not None:
                costs = [cost for mode in args.modes for cost in measure_beside(platform, mode, args)]
            else:
                costs = [measure_mode(platform, mode, args) for mode in args.modes]
        finally:
            platform.stop()
    print(render(costs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
