"""`Idempotency-Key` on the public API's POSTs: the first successful response is stored per organization and
key for 24 hours, and a retry with the same key and the same request, by the same caller with the same
authority, gets it back instead of acting twice. Secrets in a response (a new API key) are not stored: a
replay answers with them withheld (null) and names them in `Idempotent-Withheld`.

The keys share one store, and one key space per organization, with the gateway's inference requests; the
store (claim, complete, release) is named by settings.DIPTYCH_IDEMPOTENCY_STORE, so that this base of every
app's views does not depend on the app that keeps the records.
"""

import hashlib
import json
from datetime import timedelta
from functools import cache
from importlib import import_module
from types import ModuleType

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.http import QueryDict
from rest_framework import status
from rest_framework.exceptions import APIException
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.errors import InvalidInput
from controlplane.common.ids import new_public_id

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
WITHHELD_HEADER = "Idempotent-Withheld"
MAX_KEY_LENGTH = 255
# How long a request holds its key while it runs; a process that died holding one frees it after this.
LEASE = timedelta(seconds=60)


class IdempotencyKeyInUse(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "idempotency_key_in_use"


class IdempotencyKeyReused(APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "idempotency_key_reused"


class IdempotencyKeyOfAnotherCaller(APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "idempotency_key_conflict"


class _Replay(Exception):
    """Raised once the stored response of a completed request is found: the handler must not run."""

    def __init__(self, stored: dict):
        super().__init__("replayed")
        self.stored = stored


@cache
def _store() -> ModuleType:
    return import_module(settings.DIPTYCH_IDEMPOTENCY_STORE)


def idempotency_key_of(request: Request) -> str | None:
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not 1 <= len(key) <= MAX_KEY_LENGTH or not key.isascii() or not key.isprintable():
        raise InvalidInput(
            f"{HEADER} must be 1 to {MAX_KEY_LENGTH} printable ASCII characters, e.g. a UUID.",
            error_type="invalid_idempotency_key",
            fields={HEADER: ["Must be 1 to 255 printable ASCII characters."]},
        )
    return key


def request_fingerprint(request: Request) -> str:
    """The method, path and what the body says, so that a retry of one request matches however it is encoded:
    JSON by value (key order and spacing do not matter); a form by its fields and each file's name and
    sha256 (the multipart boundary, which a client draws anew on each try, and the order of the parts do not
    matter); any other body byte for byte."""
    digest = hashlib.sha256(f"{request.method} {request.path}\n".encode())
    if request.content_type.startswith("application/json"):
        digest.update(_canonical_json(request.data))
    elif request.content_type.startswith(FORM_MEDIA_TYPES):
        # Parsed, never read raw: the CSRF check of a session's POST has already read the stream.
        digest.update(_canonical_json(_form_meaning(request.data)))
    else:
        digest.update(request._request.body)
    return digest.hexdigest()


FORM_MEDIA_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def _canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _form_meaning(form: QueryDict) -> dict[str, list]:
    return {name: [_form_value_meaning(value) for value in values] for name, values in form.lists()}


def _form_value_meaning(value: object) -> object:
    if isinstance(value, UploadedFile):
        return {"filename": value.name, "sha256": _sha256_of_upload(value)}
    return value


def _sha256_of_upload(upload: UploadedFile) -> str:
    digest = hashlib.sha256()
    for chunk in upload.chunks():
        digest.update(chunk)
    upload.seek(0)  # the view reads it next
    return digest.hexdigest()


class IdempotentPostMixin(APIView):
    """Gives every POST of an APIView Idempotency-Key semantics. The view's `idempotency_scope()` names whose
    key space the key belongs to (an organization's public id), `idempotency_caller()` who asks and with what
    authority: the checks a handler makes for its caller do not run on a replay, so a stored response goes
    only to the caller that made it, holding the same authority. `idempotency_withheld_fields` names the
    response's secrets, which are never stored."""

    idempotency_claim: tuple[str, str, str] | None = None  # (scope, key, execution id) of a claimed key
    idempotency_withheld_fields: tuple[str, ...] = ()

    def idempotency_scope(self) -> str | None:
        organization = getattr(self.request.user, "organization", None)
        return organization.public_id if organization is not None else None

    def idempotency_caller(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must name the caller of an idempotent POST")

    def initial(self, request: Request, *args, **kwargs) -> None:
        super().initial(request, *args, **kwargs)
        self.idempotency_claim = None
        if request.method != "POST":
            return
        key = idempotency_key_of(request)
        if key is not None:
            self.idempotency_claim = self._claim(key, request_fingerprint(request))

    def _claim(self, key: str, fingerprint: str) -> tuple[str, str, str]:
        scope = self.idempotency_scope()
        if scope is None:
            raise InvalidInput(
                f"{HEADER} keys are kept per organization and you are not a member of one; send the request "
                "without the header.",
                error_type="invalid_idempotency_key",
            )
        execution_id = new_public_id("post")
        claim = _store().idempotency_key_claim(
            organization_id=scope,
            key=key,
            caller=self.idempotency_caller(),
            fingerprint=fingerprint,
            execution_id=execution_id,
            lease=LEASE,
        )
        if claim.outcome == "other_caller":
            raise IdempotencyKeyOfAnotherCaller(
                f"{HEADER} {key!r} was already used by another caller of this organization (another API key or "
                "member, or you under another role); a stored response goes only to the caller "
                "that made it. Use a new key."
            )
        if claim.outcome == "completed":
            raise _Replay(claim.response)
        if claim.outcome == "in_flight":
            raise IdempotencyKeyInUse(
                f"A request with {HEADER} {key!r} is still being processed; retry once it has finished."
            )
        if claim.outcome == "mismatch":
            raise IdempotencyKeyReused(
                f"{HEADER} {key!r} was already used with another request (a different method, path or body); "
                "use a new key for a new request."
            )
        return scope, key, execution_id

    def handle_exception(self, exc: Exception) -> Response:
        if isinstance(exc, _Replay):
            replayed = Response(exc.stored["body"], status=exc.stored["status"])
            replayed[REPLAYED_HEADER] = "true"
            if exc.stored.get("withheld"):
                replayed[WITHHELD_HEADER] = ", ".join(exc.stored["withheld"])
            return replayed
        return super().handle_exception(exc)

    def finalize_response(self, request: Request, response: Response, *args, **kwargs) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)
        if self.idempotency_claim is not None:
            self._settle(response)
        return response

    def _settle(self, response: Response) -> None:
        """Stores a success for retries to get back; frees the key after a failure, which changed nothing,
        so that a retry runs anew."""
        claim, self.idempotency_claim = self.idempotency_claim, None
        if claim is None:
            return
        scope, key, execution_id = claim
        if status.is_success(response.status_code):
            _store().idempotency_key_complete(
                organization_id=scope, key=key, execution_id=execution_id, response=self._stored_response(response)
            )
        else:
            _store().idempotency_key_release(organization_id=scope, key=key, execution_id=execution_id)

    def _stored_response(self, response: Response) -> dict:
        """The response as a replay gives it back, its secrets withheld: the stored copy must not hold them."""
        body = json.loads(JSONRenderer().render(response.data)) if response.data is not None else None
        if not isinstance(body, dict):
            return {"status": response.status_code, "body": body}
        withheld = [name for name in self.idempotency_withheld_fields if name in body]
        if not withheld:
            return {"status": response.status_code, "body": body}
        return {"status": response.status_code, "body": {**body, **dict.fromkeys(withheld)}, "withheld": withheld}
