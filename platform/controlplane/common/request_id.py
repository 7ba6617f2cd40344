"""Names every HTTP request the control plane serves, so that an operator can follow one: its answer carries
`X-Request-Id`, and so does every log line written while it is served (diptych_common.logs' filter adds
the id bound here to each record, as the gateway's and the workers' lines carry theirs).

A caller's own well-formed X-Request-Id (a proxy's, a script's) is kept; any other gets a fresh one. This is
the id of the HTTP request: the execution ids that the gateway's usage events carry are another thing.
"""

import re
from collections.abc import Callable

from django.core.signals import request_finished
from django.http import HttpRequest, HttpResponse

from controlplane.common.ids import new_public_id
from diptych_common.logs import bind_request

HEADER = "X-Request-Id"
WELL_FORMED = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_of(request: HttpRequest) -> str:
    """The caller's X-Request-Id when it is 1 to 128 letters, digits, '.', '_', ':' or '-'; else a new one."""
    sent = request.headers.get(HEADER, "")
    return sent if WELL_FORMED.fullmatch(sent) else new_public_id("req")


def _request_unbind(**kwargs) -> None:
    bind_request("")


class RequestIdMiddleware:
    """Binds the request's id for the log lines, and puts it on the answer. It stays bound until the answer
    is sent (request_finished), so the lines Django logs after the middleware (`Not Found: ...`) and those
    of a streamed answer carry it too; the next request binds its own."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response
        request_finished.connect(_request_unbind, dispatch_uid="controlplane.request_id.unbind")

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request_id = request_id_of(request)
        bind_request(request_id)
        response = self.get_response(request)
        response[HEADER] = request_id
        return response
