"""The control plane's verification answer, read defensively: what it does not send is allowed."""

import grpc
import pytest

from gateway.auth import RateLimits, _check_allowed, caller_from_identity
from gateway.errors import GatewayError

BASE = {"api_key_id": "key_1", "organization_id": "org_1"}


def test_an_answer_without_scopes_limits_or_spend_allows_everything():
    caller = caller_from_identity(BASE)
    assert caller.scopes is None and caller.key_limits == RateLimits() and not caller.spend.over_limit
    _check_allowed(caller)


def test_limits_and_spend_are_read():
    caller = caller_from_identity({
        **BASE, "scopes": ["inference"],
        "limits": {"organization": {"requests_per_minute": 60, "input_tokens_per_minute": None},
                   "api_key": {"output_tokens_per_minute": 1000}},
        "spend": {"limit_micros": 5_000_000, "spent_micros": 10, "over_limit": False},
    })
    assert caller.organization_limits == RateLimits(requests_per_minute=60)
    assert caller.key_limits == RateLimits(output_tokens_per_minute=1000)
    assert caller.spend.limit_micros == 5_000_000
    _check_allowed(caller)


def test_a_key_without_the_inference_scope_is_denied():
    with pytest.raises(GatewayError) as raised:
        _check_allowed(caller_from_identity({**BASE, "scopes": ["admin:read"]}))
    assert raised.value.code is grpc.StatusCode.PERMISSION_DENIED


def test_an_organization_over_its_spend_limit_is_refused_with_the_amount():
    with pytest.raises(GatewayError) as raised:
        _check_allowed(caller_from_identity(
            {**BASE, "spend": {"limit_micros": 12_500_000, "spent_micros": 12_600_000, "over_limit": True}}
        ))
    assert raised.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.message.startswith("spend limit of $12.50 reached for this billing period")
