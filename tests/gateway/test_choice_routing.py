"""Routing of an n>1 request's later choices (pinned to the first choice's workers while usable) and of
requests sharing a prompt_cache_key (the key's worker while it is usable and not overloaded, else the
ordinary choice); and the pieces of n>1 that need no worker: per-choice seeds and ids, the request's
usage, the idempotency key's stored answer."""

import pytest

from diptych_common.prefix_hash import block_hashes
from gateway.accounts.idempotency import replayed_outputs, stored_responses
from gateway.core.choices import ChoiceRun, choice_plan, choice_seed, request_usage
from gateway.routing.route import Decision, Pin, RouteRequest, ServingMode
from gateway.routing.router import MAX_SESSIONS
from gateway.types import FinishReason, GenerationOutput, GenerationPlan, PhaseUsage, SamplingSpec, Usage
from tests.gateway.test_routing import BLOCK, PREFIX, Fleet, two_by_two, worker


def session(prompt, key: str, avoid=()) -> RouteRequest:
    return RouteRequest("m", list(prompt), 16, frozenset(avoid), "org", session_key=f"org:{key}")


def test_a_pinned_choice_goes_to_its_first_choice_s_workers_while_they_are_usable():
    fleet = two_by_two()
    fleet.report("p1", cached=block_hashes(PREFIX, BLOCK))  # the prefix router would pick p1 and d1
    router = fleet.router()
    pinned = RouteRequest("m", [*PREFIX, 1], 16, pin=Pin("p2", "d2"))
    route = router.route(pinned)
    assert (route.prefill.id, route.decode.id) == ("p2", "d2")
    # A pinned worker that failed this request is avoided: ordinary routing decides.
    route = router.route(RouteRequest("m", [*PREFIX, 1], 16, frozenset({"p2", "d2"}), pin=Pin("p2", "d2")))
    assert (route.prefill.id, route.decode.id) == ("p1", "d1")
    # One that drains is no candidate.
    fleet.report("p2", draining=True)
    assert router.route(pinned).prefill.id == "p1"


def test_a_pinned_choice_of_a_colocated_request_stays_on_its_worker():
    fleet = Fleet(worker("c1", "colocated"), worker("c2", "colocated"))
    fleet.report("c1")
    fleet.report("c2")
    router = fleet.router(mode=ServingMode.COLOCATED)
    assert router.route(RouteRequest("m", [5] * 40, 16)).prefill.id == "c1"
    route = router.route(RouteRequest("m", [5] * 40, 16, pin=Pin("c2", "c2")))
    assert route.prefill.id == "c2" and route.decision is Decision.COLOCATED


def test_requests_sharing_a_prompt_cache_key_go_to_its_prefill_worker_over_the_prefix_holder():
    fleet = two_by_two()
    router = fleet.router()
    other = [500 - i for i in range(64)]
    first = router.route(session(other, "chat-1", avoid={"p1"}))  # the key's first request lands on p2
    assert first.prefill.id == "p2"
    fleet.report("p1", cached=block_hashes(PREFIX, BLOCK, "org"))
    assert router.route(RouteRequest("m", [*PREFIX, 1], 16, cache_salt="org")).prefill.id == "p1"
    # The key wins over p1's prefix: the session's own prompts meet on p2.
    assert router.route(session([*PREFIX, 1], "chat-1")).prefill.id == "p2"
    # Another organization's key of the same name is another session.
    assert router.route(RouteRequest("m", [*PREFIX, 1], 16, session_key="org2:chat-1")).prefill.id == "p1"


def test_a_prompt_cache_key_s_worker_that_is_overloaded_or_gone_yields_to_ordinary_routing():
    fleet = two_by_two()
    router = fleet.router()
    assert router.route(session([9] * 40, "chat-2", avoid={"p1"})).prefill.id == "p2"
    fleet.report("p2", queue_depth=5)  # five requests more than p1: overloaded
    assert router.route(session([9] * 40, "chat-2")).prefill.id == "p1"
    # The key now follows the worker that served it last.
    fleet.report("p2", queue_depth=0)
    assert router.route(session([9] * 40, "chat-2")).prefill.id == "p1"
    fleet.report("p1", queue_depth=4)  # four more: still within the slack
    assert router.route(session([9] * 40, "chat-2")).prefill.id == "p1"
    fleet.report("p1", draining=True)
    assert router.route(session([9] * 40, "chat-2")).prefill.id == "p2"


def test_the_session_table_is_bounded():
    fleet = two_by_two()
    router = fleet.router()
    for index in range(MAX_SESSIONS + 10):
        router._remember_session(f"org:{index}", "p1")
    assert len(router._sessions) == MAX_SESSIONS and "org:0" not in router._sessions


def plan(seed: int | None) -> GenerationPlan:
    return GenerationPlan(
        "exec_" + "0" * 32,
        "org",
        model=None,
        tokenizer=None,
        prompt_token_ids=[1, 2],
        sampling=SamplingSpec(seed=seed),
        stop=[],
    )  # type: ignore[arg-type]


def test_each_choice_has_its_own_execution_id_and_seed_derived_reproducibly():
    base = plan(seed=42)
    choices = [choice_plan(base, index) for index in range(4)]
    assert choices[0] is base
    assert [c.request_id for c in choices[1:]] == [f"{base.request_id}-c{i}" for i in (1, 2, 3)]
    seeds = [c.sampling.seed for c in choices]
    assert seeds[0] == 42 and len(set(seeds)) == 4
    assert seeds == [choice_seed(42, i) for i in range(4)]
    assert choice_seed(43, 1) != seeds[1] and all(0 <= s < 2**64 for s in seeds)
    assert choice_plan(plan(seed=None), 2).sampling.seed is None


def _run(index: int, usage: Usage) -> ChoiceRun:
    run = ChoiceRun(index, plan(None), delivery=None, trace=None)  # type: ignore[arg-type]
    run.final = GenerationOutput("exec", "x", [1], FinishReason.STOP, usage, index=index)
    return run


def test_the_request_s_usage_counts_the_prompt_once_and_sums_every_choice_s_output():
    def usage(completion: int, cached: int, worker: str) -> Usage:
        return Usage(
            prompt_tokens=40,
            completion_tokens=completion,
            cached_tokens=cached,
            prefill=PhaseUsage(40, cached, 100, 5, worker),
            decode=PhaseUsage(completion, 0, 100, 7, worker),
        )

    total = request_usage([_run(0, usage(10, 0, "p1")), _run(1, usage(6, 32, "p1")), _run(2, usage(3, 32, "p1"))])
    assert (total.prompt_tokens, total.completion_tokens, total.cached_tokens) == (40, 19, 0)
    assert total.prefill == PhaseUsage(40, 0, 100, 5, "p1")  # as billed: the prompt once, by choice 0
    assert total.decode == PhaseUsage(19, 0, 300, 21, "p1")


@pytest.mark.parametrize("n", [1, 3])
def test_an_idempotency_key_stores_every_choice_and_replays_them_in_order(n):
    usage = Usage(prompt_tokens=4, completion_tokens=2 * n, cached_tokens=0)
    outputs = [
        GenerationOutput("exec_1", f"text {i}", [i, i + 1], FinishReason.LENGTH, usage if i == n - 1 else None, i)
        for i in range(n)
    ]
    stored = stored_responses(outputs)
    assert ("choices" in stored) == (n > 1)
    assert replayed_outputs(stored) == outputs
