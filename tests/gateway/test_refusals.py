"""Requests refused by a rate limit: counted per minute, key and limit, and reported to the control plane in
batches whose rows keep their ids until acknowledged."""

import pytest

from diptych_common.internal_api.client import ControlPlaneUnavailable
from diptych_common.internal_api.messages import RefusalReport
from gateway.accounts.auth import RateLimits
from gateway.accounts.limits import RateLimited
from gateway.accounts.refusals import RefusalReporter, RefusalTally, this_minute
from tests.gateway.test_limits import caller, limiter  # noqa: F401 (the fixture, in process and in Redis)


async def test_each_refusal_is_counted_by_key_and_the_limit_that_refused(limiter):  # noqa: F811
    who = caller(org=RateLimits(output_tokens_per_minute=10), key=RateLimits(requests_per_minute=1))
    await limiter.admit(who, input_tokens=1, max_output_tokens=1)
    for _ in range(2):
        with pytest.raises(RateLimited):
            await limiter.admit(who, input_tokens=1, max_output_tokens=1)
    with pytest.raises(RateLimited):
        await limiter.admit(who, input_tokens=1, max_output_tokens=50)  # more than the organization's minute
    rows = limiter.refusals.take()
    counted = {(row.scope, row.limit, row.limit_value): row.refusals for row in rows}
    assert counted == {("api_key", "requests_per_minute", 1): 2, ("organization", "output_tokens_per_minute", 10): 1}
    assert {(row.organization_id, row.api_key_id) for row in rows} == {(who.organization_id, who.api_key_id)}
    assert {row.minute for row in rows} <= {this_minute().isoformat()}


async def test_an_admitted_request_counts_no_refusal(limiter):  # noqa: F811
    await limiter.admit(caller(key=RateLimits(requests_per_minute=5)), input_tokens=1, max_output_tokens=1)
    assert limiter.refusals.pending == 0


class FlakyControlPlane:
    """Fails its first call (the answer lost), then stores what it gets."""

    def __init__(self) -> None:
        self.calls: list[list[dict]] = []

    async def post_rate_limit_refusals(self, refusals: list[RefusalReport]) -> dict:
        self.calls.append([row.to_wire() for row in refusals])
        if len(self.calls) == 1:
            raise ControlPlaneUnavailable("control plane unreachable")
        return {"accepted": len(refusals), "duplicates": 0}


async def test_rows_are_sent_again_with_the_same_ids_until_acknowledged():
    tally = RefusalTally()
    tally.record("org_1", "key_1", "API key", "requests", 3)
    control_plane = FlakyControlPlane()
    reporter = RefusalReporter(control_plane, tally)  # type: ignore[arg-type]
    with pytest.raises(ControlPlaneUnavailable):
        await reporter.flush()
    assert reporter.pending == 1
    tally.record("org_1", "key_1", "API key", "requests", 3)  # one more in the meantime: a row of its own
    await reporter.flush()
    first, second = control_plane.calls
    assert [row["id"] for row in second][:1] == [row["id"] for row in first]
    assert [row["refusals"] for row in second] == [1, 1] and len({row["id"] for row in second}) == 2
    assert reporter.pending == 0
    await reporter.flush()
    assert len(control_plane.calls) == 2  # nothing left to send
