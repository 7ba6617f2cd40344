"""One try of a delivery over HTTP: the URL's host resolved and every address checked (addresses.py), the
request sent to a checked address (the TLS name and Host header still the URL's), no redirect followed,
no proxy from the environment, and at most a short excerpt of the answer read."""

import ssl
import time
from dataclasses import dataclass
from functools import cache

import certifi
import httpx
from django.conf import settings

from controlplane.webhooks.addresses import Destination, HostUnresolved, UnsafeDestination, resolve

USER_AGENT = "Diptych-Webhooks/1"
EXCERPT_BYTES = 200


@dataclass(frozen=True)
class TryOutcome:
    status_code: int | None  # None: no HTTP answer
    error: str  # "" when answered 2xx
    duration_ms: int
    refused: bool = False  # the destination is not allowed: no later try will be either

    @property
    def succeeded(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def post(url: str, body: bytes, headers: dict[str, str]) -> TryOutcome:
    started = time.monotonic()

    def outcome(status_code: int | None, error: str, refused: bool = False) -> TryOutcome:
        return TryOutcome(status_code, error[:500], round((time.monotonic() - started) * 1000), refused)

    try:
        destination = resolve(url)
    except HostUnresolved as error:
        return outcome(None, str(error))
    except UnsafeDestination as error:
        return outcome(None, f"Refused: {error}", refused=True)
    try:
        status_code, excerpt = _post_to_checked_address(destination, body, headers)
    except httpx.HTTPError as error:
        return outcome(None, f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    if 200 <= status_code < 300:
        return outcome(status_code, "")
    return outcome(status_code, f"HTTP {status_code}" + (f": {excerpt}" if excerpt else ""))


def _post_to_checked_address(destination: Destination, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """Tries the checked addresses in order until one connects; the answer's status and an excerpt."""
    url = destination.url
    named = str(destination.addresses[0]) != destination.host  # a name, not an address literal
    host = destination.host if named or ":" not in destination.host else f"[{destination.host}]"
    host_header = host if url.port is None else f"{host}:{url.port}"
    sent_headers = {**headers, "Host": host_header, "Content-Type": "application/json", "User-Agent": USER_AGENT}
    # The certificate is checked against the URL's name, whichever address the connection goes to.
    extensions = {"sni_hostname": destination.host} if url.scheme == "https" and named else {}
    timeout = httpx.Timeout(settings.DIPTYCH_WEBHOOK_TIMEOUT_SECONDS)
    ca_bundle = settings.DIPTYCH_WEBHOOKS_CA_BUNDLE or certifi.where()
    with httpx.Client(verify=_tls(ca_bundle), timeout=timeout, follow_redirects=False, trust_env=False) as http:
        for index, address in enumerate(destination.addresses):
            pinned = url.copy_with(host=str(address))
            try:
                request = http.build_request("POST", pinned, content=body, headers=sent_headers, extensions=extensions)
                response = http.send(request, stream=True)
            except httpx.ConnectError:
                if index == len(destination.addresses) - 1:
                    raise
                continue
            try:
                return response.status_code, _excerpt(response)
            finally:
                response.close()
    raise AssertionError("resolve() returns at least one address")


@cache
def _tls(ca_bundle: str) -> ssl.SSLContext:
    """Verification against `ca_bundle`'s authorities, built once per bundle: building it takes about 100 ms."""
    return ssl.create_default_context(cafile=ca_bundle)


def _excerpt(response: httpx.Response) -> str:
    read = b""
    for chunk in response.iter_raw():
        read += chunk
        if len(read) >= EXCERPT_BYTES:
            break
    return read[:EXCERPT_BYTES].decode("utf-8", errors="replace").strip()
