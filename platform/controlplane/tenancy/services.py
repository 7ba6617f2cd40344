from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.common.errors import CredentialRejected, InvalidInput
from controlplane.common.tokens import hash_token
from controlplane.tenancy.api_keys import display_prefix, generate_api_key, looks_like_api_key
from controlplane.tenancy.models import ApiKey, Organization
from controlplane.tenancy.selectors import api_key_get_by_hash

# Authenticating is on every request's path: recording each use would turn reads into writes.
LAST_USED_AT_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class IssuedApiKey:
    api_key: ApiKey
    key: str  # the full secret, handed to the caller once and never stored


def organization_ensure(*, name: str, slug: str) -> Organization:
    organization, _ = Organization.objects.get_or_create(slug=slug, defaults={"name": name})
    return organization


def api_key_create(*, organization: Organization, name: str, expires_at: datetime | None = None) -> IssuedApiKey:
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidInput("expires_at must be in the future.", fields={"expires_at": ["Must be in the future."]})
    key = generate_api_key()
    api_key = ApiKey.objects.create(
        organization=organization,
        name=name,
        prefix=display_prefix(key),
        key_hash=hash_token(key),
        expires_at=expires_at,
    )
    return IssuedApiKey(api_key=api_key, key=key)


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke the key; revoking it again keeps the first revocation time."""
    ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    api_key.refresh_from_db(fields=["revoked_at"])
    return api_key


def api_key_authenticate(*, key: str) -> ApiKey:
    """The live API key for `key`, its organization loaded; raises CredentialRejected saying why not."""
    if not looks_like_api_key(key):
        raise CredentialRejected(
            "Malformed API key: expected 'dip_' followed by 38 base62 characters with a valid checksum.",
            error_type="api_key_malformed",
        )
    # Looking up the SHA-256 of the key, never the key, keeps response times independent of how
    # much of a guessed key matches a real one.
    api_key = api_key_get_by_hash(key_hash=hash_token(key))
    if api_key is None:
        raise CredentialRejected("API key not recognised.", error_type="api_key_not_recognised")
    now = timezone.now()
    if api_key.revoked_at is not None:
        raise CredentialRejected(
            f"API key was revoked at {api_key.revoked_at.isoformat()}.", error_type="api_key_revoked"
        )
    if api_key.expires_at is not None and api_key.expires_at <= now:
        raise CredentialRejected(
            f"API key expired at {api_key.expires_at.isoformat()}.", error_type="api_key_expired"
        )
    _record_api_key_use(api_key=api_key, now=now)
    return api_key


def _record_api_key_use(*, api_key: ApiKey, now: datetime) -> None:
    cutoff = now - LAST_USED_AT_RESOLUTION
    if api_key.last_used_at is not None and api_key.last_used_at >= cutoff:
        return
    stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=cutoff)
    if ApiKey.objects.filter(stale, pk=api_key.pk).update(last_used_at=now):
        api_key.last_used_at = now
