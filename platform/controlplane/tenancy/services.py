from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth import authenticate, get_user_model
from django.contrib.auth.hashers import make_password
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.common.errors import CredentialRejected, InvalidInput, PermissionRefused
from controlplane.common.tokens import hash_token
from controlplane.tenancy.access import SYSTEM, Principal
from controlplane.tenancy.api_keys import display_prefix, generate_api_key, looks_like_api_key
from controlplane.tenancy.models import ApiKey, AuditEvent, Membership, Organization, Role, Scope
from controlplane.tenancy.selectors import api_key_get_by_hash, membership_list, user_get_by_email

# Authenticating is on every request's path: recording each use would turn reads into writes.
LAST_USED_AT_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class IssuedApiKey:
    api_key: ApiKey
    key: str  # the full secret, handed to the caller once and never stored


def audit_record(
    *,
    actor: Principal,
    organization: Organization | None,
    action: str,
    target_type: str,
    target_id: str,
    details: Mapping | None = None,
) -> AuditEvent:
    return AuditEvent.objects.create(
        organization=organization,
        actor_user=actor.user,
        actor_api_key=actor.api_key,
        actor=actor.label,
        action=action,
        target_type=target_type,
        target_id=target_id,
        details=dict(details or {}),
    )


def organization_ensure(*, name: str, slug: str) -> Organization:
    organization, _ = Organization.objects.get_or_create(slug=slug, defaults={"name": name})
    return organization


def _checked_scopes(scopes: Collection[str], *, actor: Principal) -> list[str]:
    unknown = sorted(set(scopes) - set(Scope.values))
    if unknown:
        raise InvalidInput(
            f"Unknown scope(s) {', '.join(unknown)}; valid scopes are {', '.join(Scope.values)}.",
            fields={"scopes": [f"Unknown scope {scope!r}." for scope in unknown]},
        )
    if not scopes:
        raise InvalidInput("A key needs at least one scope.", fields={"scopes": ["Must not be empty."]})
    if actor is not SYSTEM:
        refused = sorted(set(scopes) - actor.grantable_scopes)
        if refused:
            raise PermissionRefused(f"You may not create keys with scope(s) {', '.join(refused)}.")
    return [scope for scope in Scope.values if scope in scopes]


@transaction.atomic
def api_key_create(
    *,
    organization: Organization,
    name: str,
    scopes: Collection[str] = (Scope.INFERENCE,),
    expires_at: datetime | None = None,
    actor: Principal = SYSTEM,
) -> IssuedApiKey:
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidInput("expires_at must be in the future.", fields={"expires_at": ["Must be in the future."]})
    key = generate_api_key()
    api_key = ApiKey.objects.create(
        organization=organization,
        name=name,
        prefix=display_prefix(key),
        key_hash=hash_token(key),
        scopes=_checked_scopes(scopes, actor=actor),
        created_by=actor.user,
        expires_at=expires_at,
    )
    audit_record(
        actor=actor,
        organization=organization,
        action="api_key.create",
        target_type="api_key",
        target_id=api_key.public_id,
        details={"name": name, "scopes": api_key.scopes},
    )
    return IssuedApiKey(api_key=api_key, key=key)


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey, actor: Principal = SYSTEM) -> ApiKey:
    """Revoke the key; revoking it again keeps the first revocation time."""
    revoked = ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    api_key.refresh_from_db(fields=["revoked_at"])
    if revoked:
        audit_record(
            actor=actor,
            organization=api_key.organization,
            action="api_key.revoke",
            target_type="api_key",
            target_id=api_key.public_id,
        )
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


def user_authenticate(*, email: str, password: str):
    """The active user with this email and password; CredentialRejected otherwise (same words for both)."""
    user = user_get_by_email(email=email)
    if user is not None:
        user = authenticate(username=user.get_username(), password=password)
    else:
        make_password(password)  # as slow as a wrong password, so timing does not tell which emails exist
    if user is None or not user.is_active:
        raise CredentialRejected("Email or password is wrong.", error_type="invalid_credentials")
    return user


def user_ensure(*, email: str, password: str, is_staff: bool = False):
    """Create the user, or set the password (and staff flag) of an existing one with that email."""
    email = email.strip().lower()
    user = user_get_by_email(email=email)
    if user is None:
        user = get_user_model()(username=email, email=email)
    user.is_staff = user.is_staff or is_staff
    user.is_superuser = user.is_superuser or is_staff
    user.set_password(password)
    user.save()
    return user


def _check_role_change(*, actor: Principal, roles: Collection[str]) -> None:
    refused = sorted(set(roles) - actor.manageable_roles)
    if refused:
        raise PermissionRefused(f"You may not manage members with role(s) {', '.join(refused)}.")


def _ensure_an_owner_remains(*, organization: Organization) -> None:
    if not membership_list(organization=organization, role=Role.OWNER).exists():
        raise InvalidInput("An organization must keep at least one owner.", error_type="last_owner")


@transaction.atomic
def member_add(
    *, organization: Organization, email: str, role: str, password: str | None = None, actor: Principal = SYSTEM
) -> Membership:
    """Add a user (created with `password` when new) to the organization with `role`."""
    if actor is not SYSTEM:
        _check_role_change(actor=actor, roles=[role])
    user = user_get_by_email(email=email)
    if user is None:
        if not password:
            raise InvalidInput(
                f"No user has the email {email!r}: give a password to create one.",
                fields={"password": ["Required for a new user."]},
            )
        try:
            validate_password(password)
        except ValidationError as error:
            raise InvalidInput(f"password: {error.messages[0]}", fields={"password": error.messages}) from None
        user = user_ensure(email=email, password=password)
    elif hasattr(user, "membership"):
        raise InvalidInput(
            f"{email} is already a member of an organization.", error_type="already_member",
            fields={"email": ["Already a member of an organization."]},
        )
    try:
        with transaction.atomic():
            membership = Membership.objects.create(user=user, organization=organization, role=role)
    except IntegrityError:
        raise InvalidInput(f"{email} is already a member of an organization.", error_type="already_member") from None
    audit_record(
        actor=actor, organization=organization, action="member.add", target_type="member",
        target_id=membership.public_id, details={"email": user.email, "role": role},
    )
    return membership


@transaction.atomic
def member_set_role(*, membership: Membership, role: str, actor: Principal = SYSTEM) -> Membership:
    if actor is not SYSTEM:
        _check_role_change(actor=actor, roles=[membership.role, role])
    previous = membership.role
    membership.role = role
    membership.save(update_fields=["role"])
    _ensure_an_owner_remains(organization=membership.organization)
    audit_record(
        actor=actor, organization=membership.organization, action="member.set_role", target_type="member",
        target_id=membership.public_id, details={"email": membership.user.email, "from": previous, "to": role},
    )
    return membership


@transaction.atomic
def member_remove(*, membership: Membership, actor: Principal = SYSTEM) -> None:
    if actor is not SYSTEM:
        _check_role_change(actor=actor, roles=[membership.role])
    organization = membership.organization
    audit_record(
        actor=actor, organization=organization, action="member.remove", target_type="member",
        target_id=membership.public_id, details={"email": membership.user.email, "role": membership.role},
    )
    membership.delete()
    _ensure_an_owner_remains(organization=organization)
