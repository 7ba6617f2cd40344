"""A worker call's failure as the request path reads it: which workers are to blame, whether they look
dead, whether the request itself is at fault, and the error a client gets when no retry is left."""

import grpc

from gateway.fleet.registry import WorkerInfo
from gateway.routing.route import Route
from gateway.types import ErrorKind, GatewayError

NOT_SERVED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)  # the worker does not serve it


class WorkerFailure(Exception):
    """`request_fault`: the worker failed this request alone (INTERNAL), not itself; another worker will
    likely fail it too."""

    def __init__(
        self, error: GatewayError, culprits: tuple[WorkerInfo, ...], dead: bool, request_fault: bool = False
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.culprits = culprits
        self.dead = dead
        self.request_fault = request_fault


class FailuresOf:
    """`with FailuresOf(worker, phase):` around a read from a worker call: a timeout or a failed call
    leaves it as a WorkerFailure that blames `worker`. A class, not a generator: it wraps every read."""

    __slots__ = ("phase", "worker")

    def __init__(self, worker: WorkerInfo, phase: str) -> None:
        self.worker = worker
        self.phase = phase

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        if isinstance(error, TimeoutError):
            raise WorkerFailure(timed_out(self.worker, self.phase), (self.worker,), dead=False) from None
        if isinstance(error, grpc.aio.AioRpcError):
            raise failure(error, (self.worker,), self.phase) from None


def failure(error: grpc.aio.AioRpcError, culprits: tuple[WorkerInfo, ...], phase: str) -> WorkerFailure:
    code = error.code()
    kind = ErrorKind.DEADLINE_EXCEEDED if code is grpc.StatusCode.DEADLINE_EXCEEDED else ErrorKind.UNAVAILABLE
    if code in NOT_SERVED or code is grpc.StatusCode.INTERNAL:
        kind = ErrorKind(code.name)  # the worker's own verdict, passed on
    names = ", ".join(w.id for w in culprits)
    message = f"the {phase} worker {names} failed ({code.name}: {error.details()}); retry the request"
    return WorkerFailure(
        GatewayError(kind, message),
        culprits,
        dead=code is grpc.StatusCode.UNAVAILABLE,
        request_fault=code is grpc.StatusCode.INTERNAL,
    )


def timed_out(worker: WorkerInfo, phase: str) -> GatewayError:
    return GatewayError(
        ErrorKind.DEADLINE_EXCEEDED, f"the {phase} worker {worker.id} did not answer in time; retry the request"
    )


def ended_early(route: Route) -> GatewayError:
    worker = route.decode or route.prefill
    return GatewayError(ErrorKind.UNAVAILABLE, f"the worker {worker.id} ended its stream before the last token")
