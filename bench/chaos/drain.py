"""After the load: waiting until the gateways' usage has reached the ledger (their spools empty, the ledger's
totals still), so that what the ledger is compared with is all there is."""

import time
from typing import Protocol

import httpx

from diptych_server.stack import Stack


class ChaosPlatform(Protocol):
    """What draining reads of a platform: the chaos run's (bench.chaos.harness) or the hosts' (bench.hosts)."""

    @property
    def stack(self) -> Stack: ...

    @property
    def api_keys(self) -> dict[str, str]: ...

    @property
    def metrics_urls(self) -> list[str]: ...


DRAIN_STABLE_POLLS = 3  # the ledger unchanged for this many polls, one a second, with nothing spooled
SPOOLED_METRIC = "diptych_gateway_usage_events_spooled"


def wait_for_usage_drained(platform: ChaosPlatform, timeout_s: float) -> bool:
    """True once the gateway's spool is empty and the ledger's totals stayed the same for a few seconds."""
    deadline = time.monotonic() + timeout_s
    previous, stable = None, 0
    while time.monotonic() < deadline:
        totals = _ledger_totals(platform)
        held_back = spooled(platform.metrics_urls)
        stable = stable + 1 if totals is not None and totals == previous and held_back == 0 else 0
        if stable >= DRAIN_STABLE_POLLS:
            return True
        previous = totals
        time.sleep(1.0)
    return False


def _ledger_totals(platform: ChaosPlatform) -> tuple | None:
    """(events, tokens) per organization and phase, through each organization's usage summary."""
    totals = []
    for organization_id, api_key in sorted(platform.api_keys.items()):
        try:
            response = httpx.get(
                f"{platform.stack.control_plane_url}/api/v1/usage/summary",
                headers={"Authorization": f"Bearer {api_key}"},
                timeout=5.0,
            )
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        totals += [(organization_id, row["phase"], row["requests"], row["tokens"]) for row in response.json()["data"]]
    return tuple(totals)


def spooled(metrics_urls: list[str]) -> float | None:
    """The usage events every gateway still spools; None while one of them does not answer."""
    counts = [_gateway_metric(url, SPOOLED_METRIC) for url in metrics_urls]
    return None if any(count is None for count in counts) else sum(count or 0.0 for count in counts)


def _gateway_metric(url: str, name: str) -> float | None:
    """The metric's value; 0 when the gateway does not export it (the ledger's stability then decides
    alone), None when its metrics page does not answer."""
    try:
        text = httpx.get(url, timeout=5.0).text
    except httpx.TransportError:
        return None
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)
