from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import authenticate, get_user_model
from django.contrib.auth.hashers import make_password
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.common.errors import CredentialRejected, InvalidInput, PermissionRefused
from controlplane.common.tokens import generate_token, hash_token, is_well_formed_token
from controlplane.tenancy.access import SYSTEM, Principal
from controlplane.tenancy.api_keys import display_prefix, generate_api_key, looks_like_api_key
from controlplane.tenancy.models import (
    DEFAULT_PROJECT_NAME,
    ApiKey,
    ApiKeyKind,
    AuditEvent,
    Invitation,
    Membership,
    Organization,
    Project,
    Role,
    Scope,
)
from controlplane.tenancy.project_access import KEY_ISSUING_ROLES
from controlplane.tenancy.project_selectors import project_check_role, project_default_get
from controlplane.tenancy.selectors import api_key_get_by_hash, membership_list, user_get_by_email

INVITATION_TOKEN_PREFIX = "inv"
INVITATION_LIFETIME = timedelta(days=7)

# Authenticating is on every request's path: recording each use would turn reads into writes.
LAST_USED_AT_RESOLUTION = timedelta(minutes=1)

RATE_LIMIT_FIELDS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute")


@dataclass(frozen=True)
class IssuedInvitation:
    invitation: Invitation
    token: str  # sent to the invited address only, never stored


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
    project_default_ensure(organization=organization)
    return organization


def project_default_ensure(*, organization: Organization) -> Project:
    """The organization's default project, created the first time it is asked for."""
    project = project_default_get(organization=organization)
    if project is not None:
        return project
    try:
        with transaction.atomic():
            return Project.objects.create(organization=organization, name=DEFAULT_PROJECT_NAME, is_default=True)
    except IntegrityError:  # another request created it first (tenancy_project_one_default)
        return Project.objects.get(organization=organization, is_default=True)


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
    key: str | None = None,
    kind: str = ApiKeyKind.STANDARD,
    project: Project | None = None,
) -> IssuedApiKey:
    """Issue a key in `project` (by default the organization's default project), which the actor must own or
    be a member of. `key` is for a holder that derives its key again (a batch's runner); by default a random
    one."""
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidInput("expires_at must be in the future.", fields={"expires_at": ["Must be in the future."]})
    project = project or project_default_ensure(organization=organization)
    if project.organization_id != organization.pk:
        raise InvalidInput("The project belongs to another organization.", fields={"project_id": ["Unknown."]})
    if project.archived_at is not None:
        raise InvalidInput(f"Project {project.public_id} is archived.", error_type="project_archived")
    project_check_role(project=project, actor=actor, roles=KEY_ISSUING_ROLES, doing="issue keys")
    key = key or generate_api_key()
    api_key = ApiKey.objects.create(
        organization=organization,
        project=project,
        name=name,
        prefix=display_prefix(key),
        key_hash=hash_token(key),
        scopes=_checked_scopes(scopes, actor=actor),
        created_by=actor.user,
        expires_at=expires_at,
        kind=kind,
    )
    audit_record(
        actor=actor,
        organization=organization,
        action="api_key.create",
        target_type="api_key",
        target_id=api_key.public_id,
        details={"name": name, "scopes": api_key.scopes, "project_id": project.public_id},
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
            details={"project_id": api_key.project.public_id},
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
        raise CredentialRejected(f"API key expired at {api_key.expires_at.isoformat()}.", error_type="api_key_expired")
    if api_key.project.archived_at is not None:
        raise CredentialRejected(
            f"API key's project {api_key.project.public_id} was archived at {api_key.project.archived_at.isoformat()}.",
            error_type="api_key_project_archived",
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
            f"{email} is already a member of an organization.",
            error_type="already_member",
            fields={"email": ["Already a member of an organization."]},
        )
    try:
        with transaction.atomic():
            membership = Membership.objects.create(user=user, organization=organization, role=role)
    except IntegrityError:
        raise InvalidInput(f"{email} is already a member of an organization.", error_type="already_member") from None
    audit_record(
        actor=actor,
        organization=organization,
        action="member.add",
        target_type="member",
        target_id=membership.public_id,
        details={"email": user.email, "role": role},
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
        actor=actor,
        organization=membership.organization,
        action="member.set_role",
        target_type="member",
        target_id=membership.public_id,
        details={"email": membership.user.email, "from": previous, "to": role},
    )
    return membership


@transaction.atomic
def member_remove(*, membership: Membership, actor: Principal = SYSTEM) -> None:
    if actor is not SYSTEM:
        _check_role_change(actor=actor, roles=[membership.role])
    organization = membership.organization
    audit_record(
        actor=actor,
        organization=organization,
        action="member.remove",
        target_type="member",
        target_id=membership.public_id,
        details={"email": membership.user.email, "role": membership.role},
    )
    membership.delete()
    _ensure_an_owner_remains(organization=organization)


@transaction.atomic
def member_invite(*, organization: Organization, email: str, role: str, actor: Principal = SYSTEM) -> IssuedInvitation:
    """Invite `email` to the organization: the same answer whether or not the address has an account, or
    belongs to another organization, so the answer tells nothing about other organizations. The invitee
    accepts with the token mailed to that address (`invitation_accept`)."""
    if actor is not SYSTEM:
        _check_role_change(actor=actor, roles=[role])
    email = email.strip().lower()
    if membership_list(organization=organization).filter(user__email__iexact=email).exists():
        raise InvalidInput(
            f"{email} is already a member of this organization.",
            error_type="already_member",
            fields={"email": ["Already a member of this organization."]},
        )
    # A new invitation replaces an earlier one to the same address, whose token stops working.
    Invitation.objects.filter(organization=organization, email=email).delete()
    token = generate_token(INVITATION_TOKEN_PREFIX)
    invitation = Invitation.objects.create(
        organization=organization,
        email=email,
        role=role,
        token_hash=hash_token(token),
        expires_at=timezone.now() + INVITATION_LIFETIME,
    )
    audit_record(
        actor=actor,
        organization=organization,
        action="member.invite",
        target_type="invitation",
        target_id=invitation.public_id,
        details={"email": email, "role": role},
    )
    _send_invitation(invitation=invitation, token=token)
    return IssuedInvitation(invitation=invitation, token=token)


def _send_invitation(*, invitation: Invitation, token: str) -> None:
    body = (
        f"You are invited to join {invitation.organization.name} on Diptych as {invitation.role}.\n\n"
        f"Accept before {invitation.expires_at:%Y-%m-%d %H:%M} UTC: POST /api/v1/auth/accept-invitation with\n"
        f'{{"token": "{token}", "password": "<your password>"}}\n'
        "(a new password if you have no account yet, your current one otherwise)."
    )
    send_mail("Your Diptych invitation", body, settings.DEFAULT_FROM_EMAIL, [invitation.email], fail_silently=True)


@transaction.atomic
def invitation_revoke(*, invitation: Invitation, actor: Principal = SYSTEM) -> None:
    if actor is not SYSTEM:
        _check_role_change(actor=actor, roles=[invitation.role])
    audit_record(
        actor=actor,
        organization=invitation.organization,
        action="member.invite_revoke",
        target_type="invitation",
        target_id=invitation.public_id,
        details={"email": invitation.email},
    )
    invitation.delete()


def _live_invitation(token: str) -> Invitation:
    invitation = None
    if is_well_formed_token(token, INVITATION_TOKEN_PREFIX):
        invitation = (
            Invitation.objects.select_for_update()
            .select_related("organization")
            .filter(token_hash=hash_token(token), expires_at__gt=timezone.now())
            .first()
        )
    if invitation is None:
        raise CredentialRejected(
            "Invitation not recognised or expired: ask the organization for a new one.",
            error_type="invitation_invalid",
        )
    return invitation


def _invitee_user(*, email: str, password: str):
    """The invitee's account: the existing one, if `password` is its password, else a new one."""
    user = user_get_by_email(email=email)
    if user is None:
        try:
            validate_password(password)
        except ValidationError as error:
            raise InvalidInput(f"password: {error.messages[0]}", fields={"password": error.messages}) from None
        return user_ensure(email=email, password=password)
    if not user.is_active or not user.check_password(password):
        raise CredentialRejected(
            "This email already has an account: give its password to accept.", error_type="invalid_credentials"
        )
    if hasattr(user, "membership"):
        raise InvalidInput(
            "You already belong to an organization: leave it before accepting this invitation.",
            error_type="already_member",
        )
    return user


@transaction.atomic
def invitation_accept(*, token: str, password: str):
    """The invitee (who holds the mailed token) joins the organization; answers their user."""
    invitation = _live_invitation(token)
    user = _invitee_user(email=invitation.email, password=password)
    try:
        with transaction.atomic():
            membership = Membership.objects.create(
                user=user, organization=invitation.organization, role=invitation.role
            )
    except IntegrityError:
        raise InvalidInput(
            "You already belong to an organization: leave it before accepting this invitation.",
            error_type="already_member",
        ) from None
    audit_record(
        actor=Principal.of_user(user),
        organization=invitation.organization,
        action="member.add",
        target_type="member",
        target_id=membership.public_id,
        details={"email": user.email, "role": invitation.role, "invitation": invitation.public_id},
    )
    invitation.delete()
    return user


@transaction.atomic
def rate_limits_set(
    *, holder: Organization | ApiKey, changes: Mapping[str, int | None], actor: Principal = SYSTEM
) -> Organization | ApiKey:
    """Set some of the per-minute limits of an organization or an API key (None: unlimited). The gateway
    reads them when it next verifies a key of the organization, within its key cache time (5 s)."""
    unknown = sorted(set(changes) - set(RATE_LIMIT_FIELDS))
    if unknown or not changes:
        raise InvalidInput(
            f"Give at least one of {', '.join(RATE_LIMIT_FIELDS)}; nothing else is a rate limit.",
            fields={name: ["Not a rate limit."] for name in unknown} or None,
        )
    previous = {name: getattr(holder, name) for name in changes}
    for name, value in changes.items():
        setattr(holder, name, value)
    holder.save(update_fields=list(changes))
    audit_record(
        actor=actor,
        organization=holder if isinstance(holder, Organization) else holder.organization,
        action="rate_limits.set",
        target_type="organization" if isinstance(holder, Organization) else "api_key",
        target_id=holder.public_id,
        details={"from": previous, "to": dict(changes)},
    )
    return holder
