"""Throttling of sign-ins: a password guesser gets a few tries a minute per client address, not unlimited ones.

It is DRF's rate throttle (its window, its cache entry per address, its 429 with Retry-After), counting only
the attempts that fail, so members signing in from one address (an office, a NAT) never lock each other out.
The counts live in Django's cache (settings.CACHES: Redis when REDIS_URL is set).
"""

from collections.abc import Iterator
from contextlib import contextmanager

from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from controlplane.common.errors import CredentialRejected


class SignInFailureThrottle(SimpleRateThrottle):
    """Refuses every sign-in from a client address that failed the `sign_in_failure` rate's number of times in
    its window, whatever its credentials, until the oldest failure leaves the window."""

    scope = "sign_in_failure"

    def get_cache_key(self, request: Request, view: APIView) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}

    def throttle_success(self) -> bool:
        return True  # allowed but not counted: `failure_record` counts the attempt once it has failed

    def failure_record(self, request: Request, view: APIView) -> None:
        if self.allow_request(request, view):  # loads the window's failures as they are now
            super().throttle_success()


@contextmanager
def sign_in_failures_counted(request: Request, view: APIView) -> Iterator[None]:
    """Counts a sign-in that fails with CredentialRejected against the client's address."""
    try:
        yield
    except CredentialRejected:
        SignInFailureThrottle().failure_record(request, view)
        raise
