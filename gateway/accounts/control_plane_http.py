"""The gateway's HTTP transport to the control plane: httpx's client (the internal API's
`ControlPlaneClient`) over aiohttp's connections and parser.

The gateway calls the control plane on a request's path (an idempotency key's claim and its stored answer)
and beside every stream (usage every 100 ms, keys, the registry), all in the event loop that streams the
tokens. httpx's own transport (httpcore, anyio and h11, all Python) was about half of a call's CPU there;
aiohttp parses in C and keeps its connections with less work (docs/gateway.md, "CPU per output token").

What the client sees is what httpcore gives it: the status, the raw headers and the body as sent (httpx
decodes a compressed one, so aiohttp does not), and httpx's own errors for a connection that failed or a
call that timed out, so the client's error handling holds as it is.
"""

import aiohttp
import httpx

# Below the keep-alive of the server (gunicorn's is 2 s): an idle connection is let go before the server
# closes it, so that a call seldom meets one being closed (aiohttp sends no POST again on another).
KEEPALIVE_S = 1.0


class AiohttpTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_connections: int = 100) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session or self._open()
        try:
            async with session.request(
                request.method,
                str(request.url),
                headers=[(name.decode(), value.decode()) for name, value in request.headers.raw],
                data=await request.aread(),
                timeout=_timeout(request),
            ) as response:
                body = await response.read()
        except TimeoutError as error:  # aiohttp's timeouts are TimeoutErrors (and some ClientErrors too)
            kind = httpx.ConnectTimeout if isinstance(error, aiohttp.ConnectionTimeoutError) else httpx.ReadTimeout
            raise kind(str(error) or "timed out", request=request) from error
        except aiohttp.ClientError as error:
            raise _transport_error(error, request) from error
        return httpx.Response(
            response.status, headers=list(response.raw_headers), stream=httpx.ByteStream(body), request=request
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),  # httpx's request carries its own
            cookie_jar=aiohttp.DummyCookieJar(),  # and its client keeps the cookies
        )
        return self._session


def _timeout(request: httpx.Request) -> aiohttp.ClientTimeout:
    given = request.extensions.get("timeout", {})
    return aiohttp.ClientTimeout(
        total=None, connect=given.get("pool"), sock_connect=given.get("connect"), sock_read=given.get("read")
    )


def _transport_error(error: aiohttp.ClientError, request: httpx.Request) -> httpx.TransportError:
    message = str(error) or type(error).__name__
    if isinstance(error, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.NetworkError(message, request=request)
