"""The split gateway exports the per-phase autoscaling signals of every fleet it sees, labelled by model, role
and region, and its desired prefill replicas rise under a burst of long prompts."""

import asyncio
import random
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.gateway_client import GatewayClient

BURST = 40  # prompts of PROMPT_TOKENS, one output token each: seconds of prefill work on the test machine
PROMPT_TOKENS = 900
GAUGES = (
    "diptych_autoscale_desired_replicas",
    "diptych_autoscale_current_replicas",
    "diptych_autoscale_queue_per_worker",
    "diptych_autoscale_kv_utilisation",
)


def _autoscale_samples(metrics_url: str) -> dict[str, dict[tuple, float]]:
    """diptych_autoscale_* gauges: name -> {(model, role, region[, slo]): value}."""
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=5).text):
        if family.name.startswith("diptych_autoscale_"):
            for sample in family.samples:
                labels = sample.labels
                key = (labels["model"], labels["role"], labels["region"]) + (
                    (labels["slo"],) if "slo" in labels else ()
                )
                found.setdefault(family.name, {})[key] = sample.value
    return found


async def _burst_while_watching(live, fleet: tuple[str, str, str]) -> list[float]:
    """Sends the burst and reads the gateway's desired replicas for `fleet` every 0.25 s until 3 s after it."""
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 500) for _ in range(PROMPT_TOKENS)] for _ in range(BURST)]
    seen, done = [], asyncio.Event()

    async def watch() -> None:
        ended_at = None
        while ended_at is None or time.monotonic() - ended_at < 3.0:
            samples = await asyncio.to_thread(_autoscale_samples, live.metrics_urls["split"])
            seen.append(samples["diptych_autoscale_desired_replicas"][fleet])
            if done.is_set() and ended_at is None:
                ended_at = time.monotonic()
            await asyncio.sleep(0.25)

    async with GatewayClient(live.gateways["split"], live.api_key, "diptych-tiny") as client:

        async def burst():
            try:
                return await asyncio.wait_for(asyncio.gather(*(client.generate(p, 1) for p in prompts)), 180)
            finally:
                done.set()

        results, _ = await asyncio.gather(burst(), watch())
    assert all(r.ok for r in results), {r.error for r in results}
    return seen


def test_the_gateway_exports_each_fleet_s_signals_and_its_desired_prefill_replicas_rise_under_a_burst(live):
    fleets = {
        name: (worker["model"], worker["role"], worker["region"])
        for name, worker in live.workers.items()
        if worker["role"] in ("prefill", "decode", "colocated")
    }
    metrics_url = live.metrics_urls["split"]
    deadline = time.monotonic() + 10
    while set(fleets.values()) - set(_autoscale_samples(metrics_url).get(GAUGES[0], {})):
        assert time.monotonic() < deadline, "the gateway never exported a desired count for every fleet"
        time.sleep(0.25)
    samples = _autoscale_samples(metrics_url)
    for gauge in GAUGES:
        assert set(samples[gauge]) == set(fleets.values()), gauge
    assert samples["diptych_autoscale_current_replicas"][fleets["prefill-0"]] == 1

    before = samples["diptych_autoscale_desired_replicas"][fleets["prefill-0"]]
    seen = asyncio.run(_burst_while_watching(live, fleets["prefill-0"]))
    assert max(seen) > max(before, 1), f"desired prefill replicas stayed at {seen} (before the burst: {before})"
    ttft = _autoscale_samples(metrics_url).get("diptych_autoscale_slo_attainment", {})
    assert (*fleets["prefill-0"], "ttft") in ttft  # the burst's first tokens count for the prefill fleet
    assert 0.0 <= ttft[(*fleets["prefill-0"], "ttft")] <= 1.0
