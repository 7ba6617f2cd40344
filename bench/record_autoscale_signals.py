"""Records the live autoscaling signals of a real split stack under bounded bursts, for the scaling decision's
replay test (tests/gateway/test_autoscale.py reads tests/gateway/recorded_signals/):

    python -m bench.record_autoscale_signals [--out tests/gateway/recorded_signals]

It starts the control plane (SQLite), one prefill and one decode worker of diptych-tiny and, per scenario, a
fresh split gateway (so each recording's SLO attainment is its own), then sends the scenario's requests all
at once and samples every SAMPLE_INTERVAL_S, until they ended and a little after: each worker's load report
(GetLoad, what the gateway's LoadBoard holds) and the gateway's own diptych_autoscale_* gauges. The decode
worker runs with a small KV cache and max_running, so that a burst a 2-core machine finishes in seconds
still fills it; the gateway never moves prefill work to the decode worker (--prefill-overflow-tokens 0).

Scenarios: idle (no requests), prefill_heavy (long prompts, one output token), decode_heavy (short prompts,
long outputs).
"""

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.gateway_client import GatewayClient
from bench.stats import RequestResult
from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_server.stack import REPO_ROOT, UNLIMITED_NEW_ORGANIZATIONS, Stack, free_port

MODEL = "diptych-tiny"
SAMPLE_INTERVAL_S = 0.25
SAMPLES_AFTER = 8  # samples once every request ended (2 s): the queues drained, the attainment still recent
IDLE_SAMPLES = 12
DECODE_MAX_RUNNING = 16
DECODE_KV_CACHE_MIB = 8  # 128 blocks of 16 tokens for diptych-tiny
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 5.0
BURST_TIMEOUT_S = 240.0
DEFAULT_OUT = REPO_ROOT / "tests" / "gateway" / "recorded_signals"


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: int
    prompt_tokens: int
    output_tokens: int


SCENARIOS = (
    Scenario("idle", requests=0, prompt_tokens=0, output_tokens=0),
    Scenario("prefill_heavy", requests=24, prompt_tokens=900, output_tokens=1),
    Scenario("decode_heavy", requests=40, prompt_tokens=8, output_tokens=96),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS)
    parser.add_argument("--slo-tpot-ms", type=float, default=SLO_TPOT_MS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="diptych-autoscale-") as state:
        recorder = Recorder(Path(state), args.slo_ttft_ms, args.slo_tpot_ms)
        try:
            recorder.start()
            for scenario in SCENARIOS:
                recording = asyncio.run(recorder.record(scenario))
                path = args.out / f"{scenario.name}.json"
                path.write_text(json.dumps(recording, indent=1) + "\n")
                print(f"{scenario.name}: {len(recording['samples'])} samples, {recording['requests']} -> {path}")
        finally:
            recorder.stop()
    return 0


class Recorder:
    def __init__(self, state_dir: Path, slo_ttft_ms: float, slo_tpot_ms: float) -> None:
        self.stack = Stack(
            state_dir,
            control_plane_port=free_port(),
            database_url=f"sqlite:///{state_dir / 'cp.db'}",
            extra_env=UNLIMITED_NEW_ORGANIZATIONS,
        )
        self.slo = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}
        self.workers: dict[str, dict] = {}
        self.api_key = ""
        self._secret = ""

    def start(self) -> None:
        credentials = self.stack.prepare_control_plane(demo=True)
        self.api_key = credentials.api_key
        self.stack.start_control_plane()
        worker_options = {
            "prefill-0": (),
            "decode-0": ("--max-running", str(DECODE_MAX_RUNNING), "--kv-cache-mib", str(DECODE_KV_CACHE_MIB)),
        }
        for name, options in worker_options.items():
            role = name.split("-")[0]
            model = ("--model", MODEL, "--model-source", f"builtin:{MODEL}")
            self.stack.start_worker(name, role, credentials.fleet_tokens[role], free_port(), *model, *options)
        entries = self.stack.wait_for_workers(list(worker_options), timeout=180)
        self.workers = dict(zip(worker_options, entries, strict=True))
        self._secret = _worker_rpc_secret(self.stack)

    def stop(self) -> None:
        self.stack.stop()

    async def record(self, scenario: Scenario) -> dict:
        name, port, metrics_port = f"gateway-{scenario.name}", free_port(), free_port()
        slo_options = ("--slo-ttft-ms", str(self.slo["ttft_ms"]), "--slo-tpot-ms", str(self.slo["tpot_ms"]))
        options = ("--prefill-overflow-tokens", "0", *slo_options)
        self.stack.start_gateway(name, port, metrics_port, "split", http_port=free_port(), extra=options)
        try:
            sampler = _Sampler(self.workers, self._secret, f"http://127.0.0.1:{metrics_port}/metrics")
            results = await _burst_while_sampling(f"127.0.0.1:{port}", self.api_key, scenario, sampler)
        finally:
            self.stack.stop_process(name)
        return {
            "recorded_with": "python -m bench.record_autoscale_signals",
            "scenario": asdict(scenario),
            "slo": self.slo,
            "workers": {
                name: {
                    "model": w["model"],
                    "role": w["role"],
                    "region": w["region"],
                    "max_running": DECODE_MAX_RUNNING if w["role"] == "decode" else 64,
                }
                for name, w in self.workers.items()
            },
            "requests": _summary(results),
            "samples": sampler.samples,
        }


class _Sampler:
    """Each worker's load report and the gateway's autoscaling gauges, every SAMPLE_INTERVAL_S."""

    def __init__(self, workers: dict[str, dict], secret: str, gateway_metrics_url: str) -> None:
        self._workers = workers
        self._metadata = (("authorization", f"Bearer {secret}"),)
        self._gateway_metrics_url = gateway_metrics_url
        self.samples: list[dict] = []
        self._started = time.monotonic()

    async def run(self, done: asyncio.Event, after: int) -> None:
        self._started = time.monotonic()
        left = after
        async with httpx.AsyncClient(timeout=5.0) as http:
            while left > 0:
                if done.is_set():
                    left -= 1
                self.samples.append(await self._sample(http))
                await asyncio.sleep(SAMPLE_INTERVAL_S)

    async def _sample(self, http: httpx.AsyncClient) -> dict:
        loads = {}
        for name, worker in self._workers.items():
            async with grpc.aio.insecure_channel(worker["address"]) as channel:
                load = await worker_pb2_grpc.WorkerStub(channel).GetLoad(
                    worker_pb2.LoadRequest(), timeout=5, metadata=self._metadata
                )
            loads[name] = {
                "queue_depth": load.queue_depth,
                "prompt_tokens_pending": load.prompt_tokens_pending,
                "active_sequences": load.active_sequences,
                "kv_blocks_free": load.kv_blocks_free,
                "kv_blocks_total": load.kv_blocks_total,
            }
        gauges = _autoscale_gauges((await http.get(self._gateway_metrics_url)).text)
        return {"t": round(time.monotonic() - self._started, 3), "loads": loads, "gateway": gauges}


async def _burst_while_sampling(address: str, api_key: str, scenario: Scenario, sampler: _Sampler):
    done = asyncio.Event()
    if not scenario.requests:
        done.set()
        await sampler.run(done, IDLE_SAMPLES)
        return []
    rng = random.Random(17)
    prompts = [[rng.randrange(10, 500) for _ in range(scenario.prompt_tokens)] for _ in range(scenario.requests)]
    async with GatewayClient(address, api_key, MODEL) as client:

        async def burst() -> list[RequestResult]:
            try:
                sends = (client.generate(prompt, scenario.output_tokens) for prompt in prompts)
                return list(await asyncio.wait_for(asyncio.gather(*sends), BURST_TIMEOUT_S))
            finally:
                done.set()

        results, _ = await asyncio.gather(burst(), sampler.run(done, SAMPLES_AFTER))
    return results


def _autoscale_gauges(text: str) -> dict:
    """diptych_autoscale_* by name, then by "role" or "role/slo"."""
    gauges: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("diptych_autoscale_"):
            continue
        for sample in family.samples:
            key = sample.labels["role"] + (f"/{sample.labels['slo']}" if "slo" in sample.labels else "")
            gauges.setdefault(family.name.removeprefix("diptych_autoscale_"), {})[key] = sample.value
    return gauges


def _summary(results: list[RequestResult]) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft for r in ok)
    tpots = sorted(t for r in ok if (t := r.tpot) is not None)
    return {
        "sent": len(results),
        "ok": len(ok),
        "errors": sorted({r.error for r in results if r.error}),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4) if ttfts else None,
        "tpot_p50_s": round(tpots[len(tpots) // 2], 4) if tpots else None,
    }


def _worker_rpc_secret(stack: Stack) -> str:
    response = httpx.get(
        f"{stack.control_plane_url}/api/v1/internal/worker-credential",
        headers={"Authorization": f"Bearer {stack.internal_token}"},
        timeout=5.0,
    )
    response.raise_for_status()
    return response.json()["worker_rpc_secret"]


if __name__ == "__main__":
    sys.exit(main())
