"""Two regions end to end: a split gateway in region east, in front of one prefill and one decode worker in
each of east and west. Two client streams run throughout while east's fleet is drained through the staff
API (new requests go west, those in flight finish in east), replaced by fresh workers (traffic comes back
to east), and then SIGKILLed with streams in flight (they move to west and finish). No client sees an
error, and the ledger bills every request once, in the region that ran each phase.

Its own platform, since it drains and kills workers. With -s it prints an account of where each phase's
requests ran.
"""

import asyncio
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from diptych_server.stack import Stack, free_port
from tests.e2e.conftest import own_database, worker_load

MODEL = "diptych-tiny"
HOME, AWAY = "east", "west"  # the gateway's region, and the one it fails over to
STAFF_EMAIL = "staff@diptych.local"
STREAMS = 2
MAX_TOKENS = 32
LONG_TOKENS = 384  # the requests in flight at the kill: long enough that the kill meets them mid-way
PROMPT_TOKENS = 20
MAX_REQUESTS = 1000  # a bound on the whole run's traffic should a step never come (each also has PHASE_TIMEOUT_S)
REQUESTS_PER_PHASE = 6
PHASE_TIMEOUT_S = 60.0
WORKER_TIMEOUT_S = "5"
# When a request started, by the step the test had reached; the phases between two steps (draining,
# rejoining, killing) are the moments of change, where a request may run in either region.
PHASES = ("east", "draining", "drained", "rejoining", "rejoined", "killing", "killed")


@dataclass
class Flight:
    """One client request: what it asked, what came back and where its phases ran."""

    number: int
    phase: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    request_id: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    error: str = ""
    done: bool = False


@dataclass
class Moments:
    """What the test saw at its steps."""

    at_drain: list[Flight] = field(default_factory=list)  # requests mid-stream when east was drained
    at_kill: list[Flight] = field(default_factory=list)  # requests mid-stream when east was killed
    routed_while_drained: dict[str, float] = field(default_factory=dict)  # routes by label, in that phase
    retries_while_drained: float = 0.0


class Regions:
    def __init__(self, stack: Stack, credentials, staff_password: str, tokens: dict[str, dict[str, str]]) -> None:
        self.stack = stack
        self.credentials = credentials
        self.staff_password = staff_password
        self.tokens = tokens  # region -> role -> fleet token
        self.workers: dict[str, dict] = {}  # name -> registry entry
        self.regions: dict[str, str] = {}  # worker id -> region
        self.gateway_port = free_port()
        self.metrics_url = ""

    def start_workers(self, *names: str) -> None:
        """Workers named <region>-<role>-<n>."""
        for name in names:
            region, role, _ = name.split("-")
            self.stack.start_worker(name, role, self.tokens[region][role], free_port(), "--threads", "1")
        for name, entry in zip(names, self.stack.wait_for_workers(list(names)), strict=True):
            assert entry["region"] == name.split("-")[0], entry
            self.workers[name] = entry
            self.regions[entry["id"]] = entry["region"]

    def start_gateway(self) -> None:
        metrics_port = free_port()
        self.stack.start_gateway(
            "gateway",
            self.gateway_port,
            metrics_port,
            "split",
            http_port=free_port(),
            extra=(
                "--region",
                HOME,
                "--skip-split-below",
                "0",
                "--worker-timeout",
                WORKER_TIMEOUT_S,
                "--token-timeout",
                WORKER_TIMEOUT_S,
            ),
        )
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def drain(self, *names: str) -> None:
        """Through the staff API, as an operator would."""
        with httpx.Client(base_url=f"{self.stack.control_plane_url}/api/v1", timeout=10) as session:
            signed_in = session.post("/auth/login", json={"email": STAFF_EMAIL, "password": self.staff_password})
            assert signed_in.status_code == 200, signed_in.text
            for name in names:
                drained = session.post(
                    f"/workers/{self.workers[name]['id']}/drain",
                    headers={"X-CSRFToken": session.cookies["csrftoken"]},
                )
                assert drained.status_code == 200 and drained.json()["state"] == "draining", drained.text

    def draining(self, name: str) -> bool:
        return worker_load(self.stack, self.workers[name]["address"]).draining

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.metrics_url, timeout=5).text.splitlines():
            if line.startswith((name + " ", name + "{")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.split()[-1])
        return total

    def routed(self) -> dict[str, float]:
        """diptych_gateway_routed_requests_total by its labels, as `region local=...`."""
        counts = {}
        for line in httpx.get(self.metrics_url, timeout=5).text.splitlines():
            if line.startswith("diptych_gateway_routed_requests_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                counts[f"{labels['region']} local={labels['local']}"] = float(line.split()[-1])
        return counts

    def ledger(self) -> list[dict]:
        with httpx.Client(
            base_url=f"{self.stack.control_plane_url}/api/v1",
            headers={"Authorization": f"Bearer {self.credentials.api_key}"},
            timeout=10,
        ) as rest:
            page = rest.get("/usage-events", params={"limit": 1000}).json()
        assert not page["has_more"]
        return page["data"]


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    with own_database(tmp_path_factory.mktemp("regions-db")) as database_url:
        stack = Stack(tmp_path_factory.mktemp("regions"), control_plane_port=free_port(), database_url=database_url)
        try:
            credentials = stack.prepare_control_plane(demo=True, staff_email=STAFF_EMAIL)
            tokens = {region: stack.prepare_region(region) for region in (HOME, AWAY)}
            stack.start_control_plane()
            regions = Regions(stack, credentials, credentials.staff_password, tokens)
            regions.start_workers("east-prefill-0", "east-decode-0", "west-prefill-0", "west-decode-0")
            regions.start_gateway()
            yield regions
        finally:
            stack.stop()


class Traffic:
    """STREAMS client streams, each sending one request after another until stopped (at most MAX_REQUESTS
    in all), every request tagged with the phase it started in."""

    def __init__(self, regions: Regions) -> None:
        self.regions = regions
        self.phase = PHASES[0]
        self.max_tokens = MAX_TOKENS
        self.flights: list[Flight] = []
        self.stopped = False
        self.flowing = asyncio.Event()  # cleared: each stream finishes its request and waits
        self.flowing.set()

    async def run(self) -> None:
        await asyncio.gather(*(self._stream() for _ in range(STREAMS)))

    def mid_stream(self) -> list[Flight]:
        """Requests past their first token and well short of their last (as this client has read them: the
        decode worker may be a little ahead)."""
        return [f for f in self.flights if not f.done and 2 <= len(f.tokens) <= f.max_tokens // 4]

    def finished(self, phase: str) -> list[Flight]:
        return [f for f in self.flights if f.phase == phase and f.done]

    async def until(self, condition, what: str) -> None:
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while not condition():
            assert len(self.flights) < MAX_REQUESTS, f"{what}: not within {MAX_REQUESTS} requests; {self.summary()}"
            assert time.monotonic() < deadline, f"{what}: not within {PHASE_TIMEOUT_S} s; {self.summary()}"
            assert not any(f.error for f in self.flights), f"a client saw an error: {self.summary()}"
            await asyncio.sleep(0.01)

    def summary(self) -> str:
        return ", ".join(f"{f.number}:{f.phase}:{self.region_of(f)}:{f.error or len(f.tokens)}" for f in self.flights)

    def region_of(self, flight: Flight) -> str:
        prefill = self.regions.regions.get(flight.prefill_worker, "?")
        decode = self.regions.regions.get(flight.decode_worker, "?")
        return prefill if prefill == decode else f"{prefill}>{decode}"

    async def _stream(self) -> None:
        auth = (("authorization", f"Bearer {self.regions.credentials.api_key}"),)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.regions.gateway_port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            while not self.stopped and len(self.flights) < MAX_REQUESTS:
                await self.flowing.wait()
                if self.stopped:
                    return
                number = len(self.flights)
                prompt = [3 + (number * 37 + i * 11) % 500 for i in range(PROMPT_TOKENS)]
                flight = Flight(number, self.phase, prompt, self.max_tokens)
                self.flights.append(flight)
                await self.send(stub, auth, flight)

    async def replay(self, flights: list[Flight]) -> list[Flight]:
        """The same requests again, one after another."""
        auth = (("authorization", f"Bearer {self.regions.credentials.api_key}"),)
        replays = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.regions.gateway_port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for flight in flights:
                replays.append(Flight(flight.number, "replay", flight.prompt, flight.max_tokens))
                await self.send(stub, auth, replays[-1])
        return replays

    @staticmethod
    async def send(stub, auth, flight: Flight) -> None:
        request = inference_pb2.GenerateRequest(
            model=MODEL,
            prompt_token_ids=inference_pb2.TokenIds(ids=flight.prompt),
            max_tokens=flight.max_tokens,
            temperature=0,
            ignore_eos=True,
        )
        try:
            async for response in stub.Generate(request, metadata=auth, timeout=60):
                flight.tokens.extend(response.token_ids)
                flight.request_id = response.request_id
                if response.HasField("usage"):
                    flight.prefill_worker = response.usage.prefill.worker_id
                    flight.decode_worker = response.usage.decode.worker_id
        except grpc.aio.AioRpcError as error:
            flight.error = f"{error.code().name}: {error.details()}"
        flight.done = True


async def test_the_gateway_prefers_its_region_and_fails_over_whole_with_no_client_error(regions):
    traffic = Traffic(regions)
    running = asyncio.create_task(traffic.run())
    migrations_before = regions.metric("diptych_gateway_decode_migrations_total")
    try:
        moments = await _drive(regions, traffic)
    finally:
        traffic.stopped = True
        traffic.flowing.set()
        await running

    errors = [f for f in traffic.flights if f.error]
    assert not errors, f"clients saw errors: {[(f.number, f.phase, f.error) for f in errors]}"
    by_phase = {phase: traffic.finished(phase) for phase in PHASES}
    # Both regions up: everything in east. Drained or killed: everything in west, whole.
    assert {traffic.region_of(f) for f in by_phase["east"]} == {HOME}
    assert {traffic.region_of(f) for f in by_phase["drained"] + by_phase["killed"]} == {AWAY}
    # Drained east was not even tried: every route went straight to west, none was refused and retried.
    assert moments.routed_while_drained.keys() == {f"{AWAY} local=false"}
    assert moments.retries_while_drained == 0
    # Fresh east workers: east again, except the streams the kill moved (their prompt was billed in east).
    assert {traffic.region_of(f) for f in by_phase["rejoined"] if f not in moments.at_kill} == {HOME}
    # In flight at the drain: finished by the draining east workers. At the kill: moved whole to west, bar
    # one the decode worker had finished just before it died.
    assert moments.at_drain and {traffic.region_of(f) for f in moments.at_drain} == {HOME}
    moved = [f for f in moments.at_kill if traffic.region_of(f) == f"{HOME}>{AWAY}"]
    assert moved and {traffic.region_of(f) for f in moments.at_kill} <= {HOME, f"{HOME}>{AWAY}"}
    migrated = regions.metric("diptych_gateway_decode_migrations_total") - migrations_before
    assert migrated >= len(moved)
    # No token repeated or missing across the move: the same greedy request, asked again of west, gives
    # the same tokens.
    replays = await traffic.replay(moments.at_drain + moments.at_kill)
    for flight, replay in zip(moments.at_drain + moments.at_kill, replays, strict=True):
        assert not replay.error and traffic.region_of(replay) == AWAY, replay
        assert len(flight.tokens) == flight.max_tokens and flight.tokens == replay.tokens, flight.number

    events = await asyncio.to_thread(_ledger_once_everything_arrived, regions, traffic.flights + replays)
    _assert_billed_once_where_each_phase_ran(traffic, traffic.flights + replays, events)
    _print_account(regions, traffic, events, moments, migrated)


async def _drive(regions: Regions, traffic: Traffic) -> Moments:
    """Steps through the phases while the traffic runs."""
    moments = Moments()
    await traffic.until(lambda: len(traffic.finished("east")) >= REQUESTS_PER_PHASE, "requests in east")

    traffic.phase = "draining"
    await traffic.until(lambda: traffic.mid_stream(), "a stream mid-way")
    moments.at_drain = traffic.mid_stream()
    await asyncio.to_thread(regions.drain, "east-prefill-0", "east-decode-0")
    await traffic.until(
        lambda: regions.draining("east-prefill-0") and regions.draining("east-decode-0"), "east draining"
    )
    traffic.phase = "drained"
    # Measured once the requests sent while the drain took effect are done (one may have met a worker
    # that had just begun to drain, and been retried): from then on every route is a drained-phase one.
    await traffic.until(lambda: all(f.done for f in traffic.flights if f.phase == "draining"), "the draining phase")
    routed, retries = regions.routed(), regions.metric("diptych_gateway_retries_total")
    first = len(traffic.flights)
    await traffic.until(
        lambda: sum(f.number >= first for f in traffic.finished("drained")) >= REQUESTS_PER_PHASE,
        "requests after the drain",
    )
    moments.routed_while_drained = {
        k: v - routed.get(k, 0) for k, v in regions.routed().items() if v > routed.get(k, 0)
    }
    moments.retries_while_drained = regions.metric("diptych_gateway_retries_total") - retries

    # Fresh workers join east (the drained ones stay drained); the traffic holds while they load.
    traffic.flowing.clear()
    await traffic.until(lambda: all(f.done for f in traffic.flights), "the requests in flight")
    await asyncio.to_thread(regions.start_workers, "east-prefill-1", "east-decode-1")
    traffic.phase = "rejoining"
    traffic.flowing.set()
    await traffic.until(
        lambda: any(traffic.region_of(f) == HOME for f in traffic.finished("rejoining")), "traffic back in east"
    )
    traffic.phase = "rejoined"
    await traffic.until(lambda: len(traffic.finished("rejoined")) >= 2, "requests in east again")

    traffic.phase = "killing"
    traffic.max_tokens = LONG_TOKENS
    await traffic.until(lambda: len(traffic.mid_stream()) == STREAMS, "both streams mid-way")
    moments.at_kill = traffic.mid_stream()
    for name in ("east-prefill-1", "east-decode-1"):
        regions.stack.kill_process(name)
    traffic.phase = "killed"
    traffic.max_tokens = MAX_TOKENS
    await traffic.until(lambda: len(traffic.finished("killed")) >= REQUESTS_PER_PHASE, "requests after the kill")
    await traffic.until(lambda: all(f.done for f in moments.at_kill), "the moved streams")
    return moments


def _ledger_once_everything_arrived(regions: Regions, flights: list[Flight]) -> list[dict]:
    deadline = time.monotonic() + 30
    while regions.metric("diptych_gateway_usage_events_spooled") or len(regions.ledger()) < 2 * len(flights):
        assert time.monotonic() < deadline, "the gateway did not deliver every usage event"
        time.sleep(0.1)
    return regions.ledger()


def _assert_billed_once_where_each_phase_ran(traffic: Traffic, flights: list[Flight], events: list[dict]) -> None:
    by_request: dict[str, list[dict]] = {}
    for event in events:
        by_request.setdefault(event["request_id"], []).append(event)
    assert set(by_request) == {f.request_id for f in flights}
    for flight in flights:
        phases = {e["phase"]: e for e in by_request[flight.request_id]}
        assert len(by_request[flight.request_id]) == 2 and set(phases) == {"prefill", "decode"}, flight.number
        assert phases["prefill"]["tokens"] == PROMPT_TOKENS
        assert phases["decode"]["tokens"] == len(flight.tokens)
        assert phases["prefill"]["region"] == traffic.regions.regions[flight.prefill_worker]
        assert phases["decode"]["region"] == traffic.regions.regions[flight.decode_worker]


def _print_account(regions: Regions, traffic: Traffic, events: list[dict], moments: Moments, migrated: float) -> None:
    billed = Counter((e["request_id"], e["phase"]) for e in events)
    print(
        f"\nregions failover: a split gateway in {HOME}; {STREAMS} client streams of {MAX_TOKENS}-token requests "
        f"({LONG_TOKENS} while the kill waits for them)"
    )
    print(f"{'phase':<11}{'requests':>9}  {'ran in (prefill>decode)':<26}{'client errors':>14}")
    for phase in PHASES:
        flights = traffic.finished(phase)
        ran = Counter(traffic.region_of(f) for f in flights)
        where = ", ".join(f"{region} {count}" for region, count in sorted(ran.items())) or "-"
        print(f"{phase:<11}{len(flights):>9}  {where:<26}{sum(bool(f.error) for f in flights):>14}")
    print(
        f"mid-stream at the drain: {len(moments.at_drain)}, finished in "
        f"{sorted({traffic.region_of(f) for f in moments.at_drain})}; routes while drained "
        f"{moments.routed_while_drained}, retries {moments.retries_while_drained:.0f}"
    )
    ran = Counter(traffic.region_of(f) for f in moments.at_kill)
    print(
        f"mid-stream at the kill: {len(moments.at_kill)}, ran {dict(ran)} ({HOME}>{AWAY}: prompt billed in {HOME}, "
        f"moved to {AWAY} and finished there; {migrated:.0f} decode migrations)"
    )
    print(
        f"requests {len(traffic.flights)}, client errors {sum(bool(f.error) for f in traffic.flights)}; "
        f"usage events {len(events)}, each (request, phase) billed once: {set(billed.values()) == {1}}"
    )
    print(f"diptych_gateway_routed_requests_total: {regions.routed()}")
