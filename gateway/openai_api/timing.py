"""The end-to-end duration of each generating HTTP request, from its arrival to its answer's last byte, in
`diptych_gateway_request_duration_seconds`: once per request, refused or failed ones too, with the outcome the
request was counted with. One observation per request, none per token."""

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.metrics import timed_request
from gateway.openai_api.errors import STATUS

# The generating routes of every API the HTTP app serves, by their `api` label.
GENERATING_ROUTES = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}

_OUTCOME_OF_STATUS = {status: kind.value for kind, (status, _) in STATUS.items()}


@web.middleware
async def timed_generations(request: web.Request, handler: Handler) -> web.StreamResponse:
    api = _generating_api(request)
    if api is None:
        return await handler(request)
    with timed_request(api) as record:
        response = await handler(request)
        # Sent here, not after the middlewares return, so the time is taken at the last byte (a no-op
        # for a stream, which the handler ended itself).
        await response.prepare(request)
        await response.write_eof()
        if not record.outcome:  # answered without being counted: an idempotent replay, or a defect's 500
            record.outcome = _outcome_of(response.status)
        return response


def _generating_api(request: web.Request) -> str | None:
    resource = request.match_info.route.resource
    if request.method != "POST" or resource is None:
        return None
    return GENERATING_ROUTES.get(resource.canonical)


def _outcome_of(status: int) -> str:
    if status < 400:
        return "OK"
    return _OUTCOME_OF_STATUS.get(status, "INVALID_ARGUMENT" if status < 500 else "INTERNAL")
