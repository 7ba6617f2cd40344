"""Split against colocated serving across hosts: the same workload through a split fleet (two prefill and two
decode hosts, the KV crossing the hosts' links) and through a colocated one (the same four hosts, each
running both phases), each on a fresh platform:

    .venv/bin/python -m bench.hosts.serving [--requests 300] [--concurrency 8] [--prompt-tokens 384]

For each fleet it prints TTFT and TPOT percentiles and output tokens per second as the clients saw them,
and, from the gateway's own histograms, the mean KV hand-off time (reported by the prefill workers) and its
share of the mean TTFT, with the share of requests the gateway actually ran split. Every host is a network
namespace of this one machine: they share its cores, so the figures compare the two shapes under the same
CPU, not fleets of separate machines.
"""

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from bench.gateway_client import GatewayClient
from bench.hosts.fleet import HostsPlatform, multi_host_platform
from bench.progress import log
from bench.stats import RunSummary, Slo, summarize
from bench.workload import WorkloadSpec, make_requests
from diptych_common.builtin import DIPTYCH_TINY

MODEL = "diptych-tiny"
WARM_UP_REQUESTS = 8
SLO = Slo(ttft_s=2.0, tpot_s=0.2)
KV_TRANSFER, TTFT = "diptych_gateway_kv_transfer_seconds", "diptych_gateway_time_to_first_token_seconds"


@dataclasses.dataclass(frozen=True)
class FleetFigures:
    mode: str
    summary: RunSummary
    kv_handoff_mean_s: float  # the prefill workers' reported transfer time, per transferred request
    kv_handoffs: int
    ttft_mean_s: float  # the gateway's, arrival to first token
    split_share: float  # requests whose prefill and decode ran on different hosts

    @property
    def kv_share_of_ttft(self) -> float:
        return self.kv_handoff_mean_s * self.kv_handoffs / (self.ttft_mean_s * self.summary.requests or 1.0)


def histogram_totals(platform: HostsPlatform, name: str) -> tuple[float, float]:
    return platform.gateway_metric(f"{name}_sum"), platform.gateway_metric(f"{name}_count")


async def measure(platform: HostsPlatform, mode: str, args: argparse.Namespace) -> FleetFigures:
    spec = WorkloadSpec(
        requests=args.requests,
        prompt_tokens_mean=args.prompt_tokens,
        prompt_tokens_min=args.prompt_tokens // 2,
        prompt_tokens_max=args.prompt_tokens * 2,
        output_tokens_min=args.max_tokens,
        output_tokens_max=args.max_tokens,
        shared_prefix_share=0.0,
        shared_prefix_tokens=0,
        vocab_size=DIPTYCH_TINY.llama_config["vocab_size"],
        seed=args.seed,
    )
    async with GatewayClient(platform.gateway_address, platform.credentials.api_key, MODEL) as client:
        warm = make_requests(dataclasses.replace(spec, requests=WARM_UP_REQUESTS, seed=args.seed + 1))
        await client.replay_closed_loop(warm, args.concurrency)
        kv_before, ttft_before = histogram_totals(platform, KV_TRANSFER), histogram_totals(platform, TTFT)
        log(f"{mode}: {args.requests} requests, {args.concurrency} at a time")
        results = await client.replay_closed_loop(make_requests(spec), args.concurrency)
    kv_after, ttft_after = histogram_totals(platform, KV_TRANSFER), histogram_totals(platform, TTFT)
    handoffs = kv_after[1] - kv_before[1]
    done = [r for r in results if r.ok]
    return FleetFigures(
        mode=mode,
        summary=summarize(results, SLO),
        kv_handoff_mean_s=(kv_after[0] - kv_before[0]) / handoffs if handoffs else 0.0,
        kv_handoffs=int(handoffs),
        ttft_mean_s=(ttft_after[0] - ttft_before[0]) / max(ttft_after[1] - ttft_before[1], 1.0),
        split_share=sum(r.prefill_worker != r.decode_worker for r in done) / max(len(done), 1),
    )


def table(figures: list[FleetFigures]) -> str:
    rows = [
        "| fleet | requests (failed) | output tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 ms | ran split "
        "| KV hand-off mean ms | hand-off share of TTFT |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        s = f.summary
        ttft = " / ".join(f"{value * 1000:.0f}" for value in s.ttft)
        rows.append(
            f"| {f.mode} | {s.requests} ({s.failed}) | {s.output_tokens_per_s:.0f} | {ttft} | {s.tpot[0] * 1000:.1f} "
            f"| {f.split_share:.0%} | {f.kv_handoff_mean_s * 1000:.1f} | {f.kv_share_of_ttft:.1%} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=384, help="mean prompt length (half to twice it)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", choices=["split", "colocated"], default=["split", "colocated"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    figures = []
    for mode in args.modes:
        log(f"starting the {mode} fleet across hosts")
        with (
            tempfile.TemporaryDirectory(prefix=f"diptych-hosts-{mode}-") as state_dir,
            multi_host_platform(Path(state_dir), colocated=mode == "colocated") as platform,
        ):
            figures.append(asyncio.run(measure(platform, mode, args)))
    print(table(figures))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(f) for f in figures], indent=2))
    return 0 if all(f.summary.failed == 0 for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
