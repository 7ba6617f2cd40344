"""How the request path retries: each attempt has its own id on the workers, retries back off with
jitter, and a request that two workers failed on its own account is given up."""

from types import SimpleNamespace

import grpc
import pytest

from gateway.core.request_path import MAX_REQUEST_FAULTS, RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S, RequestPath, _backoff
from gateway.core.trace import RequestTrace
from gateway.core.worker_failures import WorkerFailure, failure
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import Registry, WorkerInfo
from gateway.routing.route import ServingMode
from gateway.routing.router import Router
from gateway.types import ErrorKind, GatewayError


class RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", "m", "local", "127.0.0.1:1", "ready", 0, 0)


def test_every_attempt_has_its_own_id_on_the_workers():
    trace = RequestTrace()
    ids = set()
    for _ in range(4):
        trace.attempts += 1
        ids.add(trace.attempt_id("exec_abc"))
    assert ids == {"exec_abc.1", "exec_abc.2", "exec_abc.3", "exec_abc.4"}


@pytest.mark.parametrize("attempt", range(2, 12))
def test_retries_back_off_exponentially_with_full_jitter(attempt):
    ceiling = min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** (attempt - 2))
    delays = [_backoff(attempt) for _ in range(200)]
    assert all(0 <= d <= ceiling for d in delays)
    assert max(delays) > ceiling / 2  # spread over the range, not a fixed wait


def test_a_worker_failing_the_request_itself_is_a_request_fault_the_client_sees_as_internal():
    error = RpcError(grpc.StatusCode.INTERNAL, "the request failed on this worker: nan")
    request_fault = failure(error, (worker("d1"),), "decode")
    assert request_fault.request_fault and not request_fault.dead
    assert request_fault.error.kind is ErrorKind.INTERNAL
    dead = failure(RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), (worker("d1"),), "decode")
    assert dead.dead and not dead.request_fault


def test_a_request_two_workers_failed_on_its_own_account_is_not_retried_further():
    channels = Channels()
    board = LoadBoard(channels)
    registry = Registry(None)
    path = RequestPath(channels, board, Router(registry, board, ServingMode.SPLIT))
    trace = RequestTrace(attempts=1)
    avoid: set[str] = set()
    plan = SimpleNamespace(request_id="exec_abc")

    def fault(worker_id: str) -> WorkerFailure:
        error = GatewayError(ErrorKind.INTERNAL, f"the decode worker {worker_id} failed")
        return WorkerFailure(error, (worker(worker_id),), dead=False, request_fault=True)

    path._after_failure(plan, fault("d1"), [], trace, avoid)  # the first: retried elsewhere
    assert avoid == {"d1"}
    trace.attempts += 1
    with pytest.raises(GatewayError) as given_up:
        path._after_failure(plan, fault("d2"), [], trace, avoid)
    assert given_up.value.kind is ErrorKind.INTERNAL
    assert trace.request_faults == MAX_REQUEST_FAULTS
