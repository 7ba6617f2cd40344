"""The gateway's idempotency keys against the running control plane: a stored answer goes only to the API
key that made the request, an answer that cannot be stored frees its key (a retry runs instead of meeting
409s until the lease ends), and a gateway killed while holding keys frees them when it starts again."""

import dataclasses

import pytest

from diptych_common.internal_api.client import ControlPlaneClient
from diptych_common.internal_api.messages import UsageEvent
from gateway.accounts.auth import Caller
from gateway.accounts.idempotency import IdempotencyKeys
from gateway.accounts.usage import UsageJournal
from gateway.types import (
    ErrorKind,
    FinishReason,
    GatewayError,
    GenerationOutput,
    GenerationRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tests.platform.conftest import INTERNAL_TOKEN

pytestmark = pytest.mark.django_db(transaction=True)

REQUEST = GenerationRequest(model="diptych-tiny", prompt="hello", max_tokens=500, n=16, top_logprobs=20)
LEASE_S = 3600.0  # as long as a long request's: only a release frees the key early


def execution(number: int) -> str:
    return f"exec_{number:032d}"


def answers(choices: int, tokens: int, top: int) -> list[GenerationOutput]:
    """A whole answer as the pipeline stores it: one output per choice, each token with its top logprobs."""
    logprobs = [
        TokenLogprob(7, "tok", -0.5, tuple(TopLogprob(i, f"alt{i}", -1.0 - i) for i in range(top)))
        for _ in range(tokens)
    ]
    outputs = [
        GenerationOutput(execution(1), "tok" * tokens, [7] * tokens, FinishReason.LENGTH, index=i, logprobs=logprobs)
        for i in range(choices)
    ]
    usage = Usage(prompt_tokens=5, completion_tokens=choices * tokens, cached_tokens=0)
    return [*outputs[:-1], dataclasses.replace(outputs[-1], usage=usage)]


def usage_event(request_id: str, phase: str, tokens: int) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        client_request_id="",
        phase=phase,
        organization_id="org_1",
        api_key_id="key_owner",
        model="diptych-tiny",
        region="local",
        worker_id=f"{phase}-0",
        tokens=tokens,
        cached_tokens=0,
        kv_bytes=0,
        compute_ms=1,
        started_at="2030-01-01T00:00:00+00:00",
        finished_at="2030-01-01T00:00:01+00:00",
    )


@pytest.fixture
def control_plane(live_server):
    return ControlPlaneClient(live_server.url, INTERNAL_TOKEN)


@pytest.fixture
def caller(org_a) -> Caller:
    return Caller(organization_id=org_a.public_id, api_key_id="key_owner")


async def assert_key_is_held(keys: IdempotencyKeys, caller: Caller, key: str) -> None:
    with pytest.raises(GatewayError) as refused:
        await keys.claim(caller, key, REQUEST, execution(99), LEASE_S)
    assert refused.value.kind is ErrorKind.ABORTED


async def test_a_stored_answer_goes_only_to_the_api_key_that_made_the_request(control_plane, caller, tmp_path):
    keys = IdempotencyKeys(control_plane, UsageJournal(tmp_path / "journal.sqlite3"))
    assert await keys.claim(caller, "k", REQUEST, execution(1), LEASE_S) is None
    other_key = Caller(organization_id=caller.organization_id, api_key_id="key_developer")
    with pytest.raises(GatewayError) as while_running:
        await keys.claim(other_key, "k", REQUEST, execution(2), LEASE_S)
    await keys.complete(caller.organization_id, "k", execution(1), answers(choices=2, tokens=3, top=1))
    with pytest.raises(GatewayError) as once_stored:
        await keys.claim(other_key, "k", REQUEST, execution(3), LEASE_S)
    for refused in (while_running.value, once_stored.value):
        assert refused.kind is ErrorKind.INVALID_ARGUMENT
        assert "another API key" in refused.message and execution(1) not in refused.message
    replay = await keys.claim(caller, "k", REQUEST, execution(4), LEASE_S)
    assert replay is not None and [output.text for output in replay] == ["tok" * 3] * 2


async def test_an_answer_too_large_to_store_frees_its_key_for_a_retry(control_plane, caller, tmp_path):
    """n=16, 500 tokens and 20 top logprobs make a 12 MB answer: over the bound, it is not sent, and the
    key is freed instead of staying in flight for the request's whole lease."""
    keys = IdempotencyKeys(control_plane, UsageJournal(tmp_path / "journal.sqlite3"))
    assert await keys.claim(caller, "big", REQUEST, execution(1), LEASE_S) is None
    await keys.complete(caller.organization_id, "big", execution(1), answers(choices=16, tokens=500, top=20))
    await keys.wait_idle(5.0)
    assert await keys.claim(caller, "big", REQUEST, execution(2), LEASE_S) is None


async def test_an_answer_the_control_plane_refuses_to_store_frees_its_key(control_plane, caller, tmp_path, settings):
    """Whatever keeps the answer from being stored (here the control plane's body limit) frees the key."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    keys = IdempotencyKeys(control_plane, UsageJournal(tmp_path / "journal.sqlite3"))
    assert await keys.claim(caller, "refused", REQUEST, execution(1), LEASE_S) is None
    await keys.complete(caller.organization_id, "refused", execution(1), answers(choices=4, tokens=50, top=2))
    await keys.wait_idle(5.0)
    assert await keys.claim(caller, "refused", REQUEST, execution(2), LEASE_S) is None


async def test_a_restarted_gateway_frees_the_keys_its_killed_run_held(control_plane, caller, tmp_path):
    journal_path = tmp_path / "journal.sqlite3"
    killed = IdempotencyKeys(control_plane, UsageJournal(journal_path))
    assert await killed.claim(caller, "held", REQUEST, execution(1), LEASE_S) is None
    assert await killed.claim(caller, "done", REQUEST, execution(2), LEASE_S) is None
    await killed.complete(caller.organization_id, "done", execution(2), answers(choices=1, tokens=2, top=0))
    # The process dies here: nothing releases "held", whose lease runs for an hour.

    restarted = IdempotencyKeys(control_plane, UsageJournal(journal_path))
    held = restarted.held_by_a_previous_run()
    assert [(h.execution_id, h.key) for h in held] == [(execution(1), "held")]
    await assert_key_is_held(restarted, caller, "held")
    await restarted.settle_held(held, [])
    assert restarted.held_by_a_previous_run() == []
    assert await restarted.claim(caller, "held", REQUEST, execution(3), LEASE_S) is None
    assert await restarted.claim(caller, "done", REQUEST, execution(4), LEASE_S) is not None  # still answered


async def test_a_restarted_gateway_stores_what_a_killed_execution_handed_over_as_its_keys_answer(
    control_plane, caller, tmp_path
):
    """gRPC's client drops the messages it had not read when the connection breaks: what the killed run
    handed over, and billed, is the key's answer, so a retry under the key fetches every billed token."""
    journal_path = tmp_path / "journal.sqlite3"
    journal = UsageJournal(journal_path)
    killed = IdempotencyKeys(control_plane, journal)
    assert await killed.claim(caller, "cut", REQUEST, execution(1), LEASE_S) is None
    events = [usage_event(execution(1), "prefill", 5), usage_event(execution(1), "decode", 1)]
    for count, token in enumerate((11, 12, 13), start=1):
        journal.keep_output(execution(1), f"t{token}", [token])
        if count == 1:
            journal.track(execution(1), events, count)
        journal.count_delivered(execution(1), count)
    # The process dies here, with three outputs handed over and counted.

    restarted_journal = UsageJournal(journal_path)
    recovered = restarted_journal.recover()
    restarted = IdempotencyKeys(control_plane, restarted_journal)
    await restarted.settle_held(restarted.held_by_a_previous_run(), recovered)
    billed = {body["phase"]: body["tokens"] for _, body in restarted_journal.oldest(10)}
    assert billed == {"prefill": 5, "decode": 3}
    resume = dataclasses.replace(REQUEST, resume_request_id=execution(1))
    (replay,) = await restarted.claim(caller, "cut", resume, execution(2), LEASE_S)
    assert (replay.request_id, replay.text, replay.token_ids) == (execution(1), "t11t12t13", [11, 12, 13])
    assert replay.finish_reason is FinishReason.INTERRUPTED
    assert replay.usage is not None and (replay.usage.prompt_tokens, replay.usage.completion_tokens) == (5, 3)
    assert restarted_journal.kept_outputs(execution(1), 3) == []  # settled: nothing left on disk


async def test_a_killed_execution_that_handed_nothing_over_frees_its_key(control_plane, caller, tmp_path):
    journal_path = tmp_path / "journal.sqlite3"
    killed = IdempotencyKeys(control_plane, UsageJournal(journal_path))
    assert await killed.claim(caller, "none", REQUEST, execution(1), LEASE_S) is None
    restarted_journal = UsageJournal(journal_path)
    restarted = IdempotencyKeys(control_plane, restarted_journal)
    await restarted.settle_held(restarted.held_by_a_previous_run(), restarted_journal.recover())
    resume = dataclasses.replace(REQUEST, resume_request_id=execution(1))
    with pytest.raises(GatewayError, match=f"nothing of request {execution(1)} is stored") as refused:
        await restarted.claim(caller, "none", resume, execution(2), LEASE_S)
    assert refused.value.kind is ErrorKind.NOT_FOUND
    assert await restarted.claim(caller, "none", REQUEST, execution(3), LEASE_S) is None  # free: runs anew


async def test_a_resume_names_the_execution_whose_answer_it_fetches(control_plane, caller, tmp_path):
    keys = IdempotencyKeys(control_plane, UsageJournal(tmp_path / "journal.sqlite3"))
    assert await keys.claim(caller, "done", REQUEST, execution(1), LEASE_S) is None
    await keys.complete(caller.organization_id, "done", execution(1), answers(choices=1, tokens=2, top=0))
    with pytest.raises(GatewayError, match="nothing of request exec_9") as refused:
        await keys.claim(caller, "done", dataclasses.replace(REQUEST, resume_request_id="exec_9"), execution(2), 60)
    assert refused.value.kind is ErrorKind.NOT_FOUND


async def test_an_execution_claiming_its_key_again_after_a_lost_answer_holds_it(control_plane, caller, tmp_path):
    """A claim whose answer was lost (a timeout) is sent again by the same execution: it still holds the key."""
    keys = IdempotencyKeys(control_plane, UsageJournal(tmp_path / "journal.sqlite3"))
    assert await keys.claim(caller, "again", REQUEST, execution(1), LEASE_S) is None
    assert await keys.claim(caller, "again", REQUEST, execution(1), LEASE_S) is None
    await assert_key_is_held(keys, caller, "again")
