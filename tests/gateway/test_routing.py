"""Routing decisions from the workers' live load reports: prefix affinity weighed against queues,
decode room, region preference, failed and silent workers, and the split skip."""

import pytest

from diptych_common.prefix_hash import block_hashes
from diptych_common.proto.v1 import worker_pb2
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import Registry, WorkerInfo
from gateway.routing.route import Decision, RouteRequest, ServingMode
from gateway.routing.router import Router
from gateway.types import GatewayError

BLOCK = 16
PREFIX = list(range(3, 3 + 256))  # 16 full blocks


def worker(worker_id: str, role: str, region: str = "local", state: str = "ready") -> WorkerInfo:
    return WorkerInfo(worker_id, role, "m", region, f"127.0.0.1:{hash(worker_id) % 1000 + 40000}", state, 0, 0)


class Fleet:
    def __init__(self, *workers: WorkerInfo) -> None:
        self.registry = Registry(control_plane=None)
        self.registry.workers = list(workers)
        self.board = LoadBoard(Channels())
        self.by_id = {w.id: w for w in workers}

    def report(self, worker_id: str, cached: list[int] = (), **fields) -> None:
        load = worker_pb2.Load(worker_id=worker_id, block_size=BLOCK, **fields)
        load.prefix_cache.block_hashes.extend(cached)
        load.prefix_cache.version = len(cached)
        self.board.report(self.by_id[worker_id], load)

    def router(self, mode=ServingMode.SPLIT, region="local", skip_split_below=0, prefill_overflow_tokens=0) -> Router:
        return Router(self.registry, self.board, mode, region, skip_split_below, prefill_overflow_tokens)


def request(prompt, max_tokens=16, avoid=()) -> RouteRequest:
    return RouteRequest("m", list(prompt), max_tokens, frozenset(avoid))


def two_by_two(**decode_fields) -> Fleet:
    fleet = Fleet(worker("p1", "prefill"), worker("p2", "prefill"), worker("d1", "decode"), worker("d2", "decode"))
    for name in ("p1", "p2", "d1", "d2"):
        fleet.report(name, **decode_fields)
    return fleet


def test_the_prefill_worker_holding_the_longest_prefix_wins():
    fleet = two_by_two()
    fleet.report("p2", cached=block_hashes(PREFIX, BLOCK)[:10])
    fleet.report("p1", cached=block_hashes(PREFIX, BLOCK)[:4])
    route = fleet.router().route(request([*PREFIX, 7, 8, 9]))
    assert route.prefill.id == "p2" and route.matched_tokens == 160 and route.decision is Decision.SPLIT


def test_a_hot_worker_loses_new_prompts_but_keeps_affinity_for_the_others():
    fleet = two_by_two()
    other = [500 - i for i in range(256)]
    fleet.report("p1", cached=block_hashes(PREFIX, BLOCK), queue_depth=6)
    fleet.report("p2", cached=block_hashes(other, BLOCK), queue_depth=0)
    router = fleet.router()
    # p1 holds PREFIX but six requests wait on it: the 256 tokens are cheaper to recompute on p2.
    assert router.route(request([*PREFIX, 1])).prefill.id == "p2"
    # A prompt cached on p2 still goes to p2; p1's queue changed nothing about p2's affinity.
    assert router.route(request([*other, 1])).prefill.id == "p2"
    fleet.report("p1", cached=block_hashes(PREFIX, BLOCK), queue_depth=1)
    assert router.route(request([*PREFIX, 1])).prefill.id == "p1"


def test_requests_in_flight_from_this_gateway_count_before_the_next_report():
    fleet = two_by_two()
    router = fleet.router()
    first = router.route(request([5] * 40))
    router.acquire(first)
    second = router.route(request([5] * 40))
    assert {first.prefill.id, second.prefill.id} == {"p1", "p2"}
    assert {first.decode.id, second.decode.id} == {"d1", "d2"}


def test_decode_worker_needs_free_blocks_for_the_whole_sequence_then_fewest_sequences():
    fleet = two_by_two()
    fleet.report("d1", kv_blocks_total=100, kv_blocks_free=3, active_sequences=0)
    fleet.report("d2", kv_blocks_total=100, kv_blocks_free=50, active_sequences=5)
    router = fleet.router()
    assert router.route(request([5] * 100, max_tokens=20)).decode.id == "d2"  # 8 blocks needed
    assert router.route(request([5] * 20, max_tokens=10)).decode.id == "d1"  # 2 blocks: d1 is idle


def test_same_region_first_then_other_regions():
    fleet = Fleet(
        worker("p-eu", "prefill", "eu"),
        worker("p-us", "prefill", "us"),
        worker("d-eu", "decode", "eu"),
        worker("d-us", "decode", "us"),
    )
    for name in fleet.by_id:
        fleet.report(name)
    fleet.report("p-us", queue_depth=0)
    fleet.report("p-eu", queue_depth=20)
    router = fleet.router(region="eu")
    route = router.route(request([5] * 10))
    assert (route.prefill.id, route.decode.id) == ("p-eu", "d-eu")
    route = router.route(request([5] * 10, avoid={"p-eu", "d-eu"}))
    assert (route.prefill.id, route.decode.id) == ("p-us", "d-us")


def test_broken_draining_and_silent_workers_get_no_new_work():
    fleet = two_by_two()
    fleet.board.mark_broken("p1")
    fleet.report("d1", draining=True)
    router = fleet.router()
    for _ in range(3):
        route = router.route(request([5] * 10))
        assert (route.prefill.id, route.decode.id) == ("p2", "d2")
    fleet.board.mark_broken("p2")
    with pytest.raises(GatewayError) as raised:
        router.route(request([5] * 10))
    assert "no ready prefill and decode workers serve m" in raised.value.message


def test_a_worker_that_failed_this_request_is_used_again_only_when_nothing_else_is_left():
    fleet = two_by_two()
    router = fleet.router()
    assert router.route(request([5] * 10, avoid={"p1"})).prefill.id == "p2"
    assert router.route(request([5] * 10, avoid={"p1", "p2"})).prefill.id in {"p1", "p2"}


def test_short_prompts_skip_the_split_unless_the_decode_worker_refused_generate():
    fleet = two_by_two()
    router = fleet.router(skip_split_below=32)
    short = router.route(request([5] * 20))
    assert short.decision is Decision.SPLIT_SKIPPED and short.colocated and short.prefill.role == "decode"
    assert router.route(request([5] * 100)).decision is Decision.SPLIT
    for decode in ("d1", "d2"):
        router.note_no_generate(decode)
    assert router.route(request([5] * 20)).decision is Decision.SPLIT


def test_a_prompt_the_decode_worker_holds_skips_the_split():
    fleet = two_by_two()
    fleet.report("d1", cached=block_hashes(PREFIX, BLOCK))
    fleet.report("d2", active_sequences=3)
    route = fleet.router(skip_split_below=32).route(request([*PREFIX, 1, 2]))
    assert route.decision is Decision.SPLIT_SKIPPED and route.prefill.id == "d1" and route.matched_tokens == 256


def one_by_one() -> Fleet:
    fleet = Fleet(worker("p1", "prefill"), worker("d1", "decode"))
    fleet.report("p1")
    fleet.report("d1")
    return fleet


def test_a_backed_up_prefill_fleet_overflows_onto_the_decode_worker():
    fleet = one_by_one()
    router = fleet.router(prefill_overflow_tokens=2048)
    fleet.report("p1", prompt_tokens_pending=2047)
    assert router.route(request([5] * 100)).decision is Decision.SPLIT
    fleet.report("p1", prompt_tokens_pending=3000)
    route = router.route(request([5] * 100))
    assert route.decision is Decision.SPLIT_SKIPPED and route.prefill.id == "d1" and route.colocated
    assert fleet.router().route(request([5] * 100)).decision is Decision.SPLIT  # 0: never


def test_overflow_only_onto_a_decode_worker_with_less_ahead_that_serves_generate():
    fleet = one_by_one()
    router = fleet.router(prefill_overflow_tokens=2048)
    fleet.report("p1", prompt_tokens_pending=3000)
    fleet.report("d1", prompt_tokens_pending=2950)
    assert router.route(request([5] * 100)).decision is Decision.SPLIT  # 3050 on d1 would be later
    assert router.route(request([5] * 40)).decision is Decision.SPLIT_SKIPPED  # 2990
    router.note_no_generate("d1")
    assert router.route(request([5] * 40)).decision is Decision.SPLIT


def test_prompts_this_gateway_sent_count_as_backlog_until_their_first_token():
    fleet = one_by_one()  # no worker has reported any backlog
    router = fleet.router(prefill_overflow_tokens=2048)
    leases = []
    for _ in range(16):
        route = router.route(request([5] * 128))
        assert route.decision is Decision.SPLIT
        leases.append(router.acquire(route))
    overflow = router.route(request([5] * 128))  # 16 x 128 tokens wait on p1, none on d1
    assert overflow.decision is Decision.SPLIT_SKIPPED
    skipped = router.acquire(overflow)
    leases[0].release("p1")  # a first token came: 15 x 128 left on p1
    assert router.route(request([5] * 128)).decision is Decision.SPLIT
    leases.append(router.acquire(router.route(request([5] * 128))))  # 16 x 128 again
    assert router.route(request([5] * 128)).decision is Decision.SPLIT_SKIPPED  # d1: 128 + 128 ahead
    skipped.release()
    assert router._prompting == {"p1": 16 * 128, "d1": 0}


def test_auto_mode_falls_back_to_colocated_workers():
    fleet = Fleet(worker("c1", "colocated"), worker("p1", "prefill"))
    fleet.report("c1")
    fleet.report("p1")
    route = fleet.router(mode=ServingMode.AUTO).route(request([5] * 10))
    assert route.decision is Decision.COLOCATED and route.prefill.id == "c1"
    with pytest.raises(GatewayError):
        fleet.router(mode=ServingMode.SPLIT).route(request([5] * 10))


def test_a_prefill_worker_stops_counting_a_request_once_its_first_token_came():
    fleet = two_by_two()
    router = fleet.router()
    first = router.route(request([5] * 40))
    lease = router.acquire(first)
    assert router.route(request([5] * 40)).prefill.id != first.prefill.id
    lease.release(first.prefill.id)  # prefill done; the decode worker still holds the sequence
    assert router.route(request([5] * 40)).prefill.id == first.prefill.id
    assert router.route(request([5] * 40)).decode.id != first.decode.id
    lease.release()
    assert router.route(request([5] * 40)).decode.id == first.decode.id


def test_prefix_affinity_holds_within_an_organization_and_never_across():
    fleet = two_by_two()
    fleet.report("p2", cached=block_hashes(PREFIX, BLOCK, "org-a"))
    router = fleet.router()
    same = router.route(RouteRequest("m", [*PREFIX, 1], 16, cache_salt="org-a"))
    assert same.prefill.id == "p2" and same.matched_tokens == 256
    other = router.route(RouteRequest("m", [*PREFIX, 1], 16, cache_salt="org-b"))
    assert other.matched_tokens == 0 and other.prefill.id == "p1"


def test_a_continuation_right_after_its_request_ended_finds_the_worker_that_holds_it():
    """The worker reports the blocks a finished request left it up to 50 ms later; a continuation sent
    sooner (a conversation's next turn) must still go to it rather than recompute the conversation."""
    fleet = two_by_two()
    fleet.report("p1", cached=block_hashes(PREFIX[:64], BLOCK))  # the first turn's prompt
    router = fleet.router(skip_split_below=32)
    first = router.route(request(PREFIX[:64]))
    assert (first.prefill.id, first.decision) == ("p1", Decision.SPLIT)
    conversation = PREFIX[:104]  # 64 prompt tokens, 40 output tokens: the last never fed back
    continuation = request([*conversation, 9, 9, 9])
    assert router.route(continuation).prefill.id == "p1"  # before the end: only p1 holds any of it
    router.note_finished(first, conversation, "")
    routed = router.route(continuation)
    assert (routed.decision, routed.prefill.id, routed.matched_tokens) == (Decision.SPLIT_SKIPPED, first.decode.id, 96)
    fleet.report(first.decode.id, cached=block_hashes(conversation[:96], BLOCK))  # its report, once it came
    assert router.route(continuation).matched_tokens == 96
