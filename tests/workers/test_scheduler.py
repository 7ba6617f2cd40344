"""The scheduler alone: token budget, chunked prompts, priorities, queueing and preemption."""

from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.request import BATCH, EngineRequest, RequestStatus
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Scheduler

SIZE = 4


def request(name: str, length: int, priority: int = 0) -> EngineRequest:
    return EngineRequest(name, list(range(10, 10 + length)), SamplingParams(temperature=0.0, max_tokens=100), priority)


def step(scheduler: Scheduler):
    """Schedules a step and plays the engine's part: computed tokens advance, samplers add a token."""
    out = scheduler.schedule()
    out.sampling = [chunk.samples for chunk in out.chunks]
    for chunk in out.chunks:
        chunk.request.num_computed_tokens += chunk.num_tokens
        if chunk.samples:
            chunk.request.output_token_ids.append(1)
    return out


def planned(out) -> dict[str, int]:
    return {chunk.request.request_id: chunk.num_tokens for chunk in out.chunks}


def test_decodes_go_first_and_prompts_share_what_is_left_of_the_budget():
    scheduler = Scheduler(KVCacheManager(64, SIZE), token_budget=20)
    for name in ("a", "b"):
        scheduler.add(request(name, 6))
    assert planned(step(scheduler)) == {"a": 6, "b": 6}
    scheduler.add(request("long", 50))
    assert planned(step(scheduler)) == {"a": 1, "b": 1, "long": 18}
    assert planned(step(scheduler)) == {"a": 1, "b": 1, "long": 18}
    assert planned(step(scheduler)) == {"a": 1, "b": 1, "long": 14}


def test_prompt_tokens_pending_counts_what_is_queued_and_not_yet_computed():
    scheduler = Scheduler(KVCacheManager(64, SIZE), token_budget=16)
    scheduler.add(request("long", 40))
    scheduler.add(request("short", 6))
    assert scheduler.prompt_tokens_pending == 46
    step(scheduler)  # 16 of the long prompt
    assert scheduler.prompt_tokens_pending == 30
    step(scheduler)
    step(scheduler)  # the long prompt is done, and 6 of the short one
    assert scheduler.prompt_tokens_pending == 0


def test_a_long_prompt_is_chunked_and_samples_only_at_its_end():
    scheduler = Scheduler(KVCacheManager(64, SIZE), token_budget=16)
    scheduler.add(request("long", 40))
    outs = [step(scheduler) for _ in range(3)]
    assert [o.chunks[0].num_tokens for o in outs] == [16, 16, 8]
    assert [o.sampling[0] for o in outs] == [False, False, True]


def test_interactive_requests_are_admitted_before_batch_ones():
    scheduler = Scheduler(KVCacheManager(64, SIZE), token_budget=100, max_running=2)
    scheduler.add(request("batch-1", 5, BATCH))
    scheduler.add(request("batch-2", 5, BATCH))
    scheduler.add(request("interactive", 5))
    assert list(planned(step(scheduler))) == ["interactive", "batch-1"]
    assert scheduler.waiting_count(BATCH) == 1


def test_new_requests_wait_when_blocks_run_out_and_no_running_request_is_disturbed():
    scheduler = Scheduler(KVCacheManager(4, SIZE), token_budget=100)
    scheduler.add(request("a", 12))
    scheduler.add(request("b", 8))
    out = step(scheduler)
    assert planned(out) == {"a": 12} and not out.preempted
    assert scheduler.num_waiting == 1


def test_when_a_running_request_needs_a_block_the_latest_lowest_priority_one_is_preempted():
    kv = KVCacheManager(5, SIZE)
    scheduler = Scheduler(kv, token_budget=100)
    first, second, third = request("first", 4), request("second", 4, BATCH), request("third", 4)
    for r in (first, second, third):
        scheduler.add(r)
    step(scheduler)  # three prompts of one block each, three more tokens each
    out = step(scheduler)  # each needs a second block: only two are free
    assert [r.request_id for r in out.preempted] == ["second"]
    assert second.status is RequestStatus.WAITING and second.num_computed_tokens == 0
    assert "second" not in kv.block_tables and second.num_preemptions == 1
    assert planned(out) == {"first": 1, "third": 1}
    # Once memory is back, the preempted request is recomputed from all its tokens.
    first_scheduled_ns = second.scheduled_ns
    scheduler.finish(first)
    out = step(scheduler)
    assert planned(out)["second"] == 5
    # its queueing (the trace's worker.queue span) ended when it was first scheduled, not at readmission
    assert second.scheduled_ns == first_scheduled_ns > 0


def test_an_earlier_batch_request_is_preempted_when_a_later_interactive_one_needs_a_block():
    kv = KVCacheManager(3, SIZE)
    scheduler = Scheduler(kv, token_budget=100)
    batch = request("batch", 2, BATCH)
    scheduler.add(batch)
    step(scheduler)  # the batch request runs alone: one block
    interactive = request("interactive", 8)
    scheduler.add(interactive)
    step(scheduler)  # the interactive prompt takes the two other blocks
    assert [r.request_id for r in scheduler.running] == ["batch", "interactive"]
    out = step(scheduler)  # the interactive request's 9th token needs a third block; none is free
    assert [r.request_id for r in out.preempted] == ["batch"]
    assert planned(out) == {"interactive": 1}  # the batch request's token this step was withdrawn
    assert batch.status is RequestStatus.WAITING and "batch" not in kv.block_tables
    assert interactive.num_preemptions == 0 and len(kv.block_tables["interactive"]) == 3


def test_after_an_earlier_victim_every_later_request_is_still_scheduled_once():
    kv = KVCacheManager(4, SIZE)
    scheduler = Scheduler(kv, token_budget=100)
    batch = request("batch", 2, BATCH)
    scheduler.add(batch)
    step(scheduler)
    first, second = request("first", 8), request("second", 4)
    scheduler.add(first)
    scheduler.add(second)
    step(scheduler)  # the pool is full: batch 1 block, first 2, second 1
    out = step(scheduler)
    # first needs a block: batch goes; then second needs one and is itself the latest interactive request.
    assert [r.request_id for r in out.preempted] == ["batch", "second"]
    assert planned(out) == {"first": 1}
    assert [r.request_id for r in scheduler.running] == ["first"]


def test_a_request_that_is_the_only_victim_preempts_itself():
    kv = KVCacheManager(2, SIZE)
    scheduler = Scheduler(kv, token_budget=100)
    a, b = request("a", 4), request("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    out = step(scheduler)  # both need a second block; none is free
    assert [r.request_id for r in out.preempted] == ["b"]
    assert planned(out) == {"a": 1}


def test_finish_frees_blocks_wherever_the_request_is():
    kv = KVCacheManager(8, SIZE)
    scheduler = Scheduler(kv, token_budget=100)
    running, waiting = request("running", 6), request("waiting", 60)
    scheduler.add(running)
    step(scheduler)
    scheduler.add(waiting)
    scheduler.finish(running)
    scheduler.finish(waiting)
    assert kv.num_free_blocks == 8 and not scheduler.running and scheduler.num_waiting == 0


# ---- scheduling ahead of a step under way (asynchronous scheduling) ------------------------------------


def launch(scheduler: Scheduler):
    """Schedules a step and launches it as the engine does; its outputs are not processed yet."""
    out = scheduler.schedule()
    scheduler.commit(out)
    return out


def processed(out) -> None:
    """The engine's update of a launched step: each sampling chunk's placeholder becomes its token."""
    for chunk in out.chunks:
        if chunk.samples:
            chunk.request.num_output_placeholders -= 1
            chunk.request.output_token_ids.append(1)


def test_a_step_scheduled_ahead_decodes_from_the_placeholder_of_the_step_under_way():
    scheduler = Scheduler(KVCacheManager(64, SIZE), token_budget=16)
    short, long = request("short", 6), request("long", 24)
    scheduler.add(short)
    scheduler.add(long)
    first = launch(scheduler)  # short's whole prompt (it samples), 10 of long's
    assert [(c.start, c.num_tokens, c.samples) for c in first.chunks] == [(0, 6, True), (0, 10, False)]
    assert short.num_computed_tokens == 6 and short.num_output_placeholders == 1
    second = launch(scheduler)  # before the first's outputs: short decodes its placeholder, long goes on
    assert [(c.start, c.num_tokens, c.samples) for c in second.chunks] == [(6, 1, True), (10, 14, True)]
    assert short.num_output_placeholders == 2 and long.num_output_placeholders == 1
    processed(first)
    assert short.num_tokens == 7 and short.num_output_placeholders == 1
    third = launch(scheduler)
    assert [(c.start, c.num_tokens) for c in third.chunks] == [(7, 1), (24, 1)]
    assert len(scheduler.kv.block_ids("short")) == scheduler.kv.blocks_for(8)  # a slot for every token it computes


def test_a_request_whose_token_under_way_is_surely_its_last_gets_no_chunk_after_it():
    scheduler = Scheduler(KVCacheManager(64, SIZE), token_budget=64, context_length=12)
    capped = EngineRequest("capped", list(range(10, 16)), SamplingParams(temperature=0.0, max_tokens=1))
    migrated_capped = EngineRequest(
        "migrated", list(range(10, 18)), SamplingParams(temperature=0.0, max_tokens=3, tokens_already_generated=2)
    )
    handing_off = EngineRequest("prefill", list(range(10, 15)), SamplingParams(max_tokens=50), prefill_only=True)
    at_context = request("context", 11)
    going_on = request("going-on", 5)
    for r in (capped, migrated_capped, handing_off, at_context, going_on):
        scheduler.add(r)
    launch(scheduler)
    assert planned(launch(scheduler)) == {"going-on": 1}
    aborted = request("aborted", 4)
    scheduler.add(aborted)
    launch(scheduler)
    aborted.aborted = True  # it leaves once no step holds it; until then it gets nothing more
    assert "aborted" not in planned(launch(scheduler))


def test_a_chunk_knows_whether_it_samples_once_its_step_is_launched():
    scheduler = Scheduler(KVCacheManager(64, SIZE), token_budget=8)
    scheduler.add(request("a", 4))
    [chunk] = launch(scheduler).chunks
    assert chunk.samples  # though the request's counts moved on: its placeholder is counted now
    assert chunk.request.num_tokens_with_placeholders == 5 and chunk.request.num_computed_tokens == 4
