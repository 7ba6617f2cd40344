from django.contrib.auth import get_user_model
from django.db.models import QuerySet

from controlplane.common.errors import ObjectNotFound
from controlplane.common.querysets import where_given
from controlplane.tenancy.models import ApiKey, AuditEvent, Invitation, Membership, Organization
from controlplane.tenancy.scoping import organization_rows


def organization_get(*, public_id: str) -> Organization:
    organization = Organization.objects.filter(public_id=public_id).first()
    if organization is None:
        raise ObjectNotFound(f"Organization {public_id!r} not found.")
    return organization


def api_key_list(*, organization: Organization, created_by=None, kind: str | None = None) -> QuerySet[ApiKey]:
    """The organization's keys; with `created_by`, only the keys that user created; with `kind`, only those
    of that kind."""
    api_keys = organization_rows(ApiKey, organization=organization).select_related("project")
    api_keys = where_given(api_keys, created_by=created_by, kind=kind)
    return api_keys.order_by("-created_at", "-id")


def api_key_get(*, organization: Organization, public_id: str, created_by=None) -> ApiKey:
    api_key = api_key_list(organization=organization, created_by=created_by).filter(public_id=public_id).first()
    if api_key is None:
        raise ObjectNotFound(f"API key {public_id!r} not found.")
    return api_key


def api_key_get_by_hash(*, key_hash: str) -> ApiKey | None:
    return ApiKey.objects.select_related("organization", "project").filter(key_hash=key_hash).first()


def membership_list(*, organization: Organization, role: str | None = None) -> QuerySet[Membership]:
    memberships = organization_rows(Membership, organization=organization).select_related("user")
    memberships = where_given(memberships, role=role)
    return memberships.order_by("created_at", "id")


def membership_get(*, organization: Organization, public_id: str) -> Membership:
    membership = membership_list(organization=organization).filter(public_id=public_id).first()
    if membership is None:
        raise ObjectNotFound(f"Member {public_id!r} not found.")
    return membership


def invitation_list(*, organization: Organization) -> QuerySet[Invitation]:
    return organization_rows(Invitation, organization=organization).order_by("created_at", "id")


def invitation_get(*, organization: Organization, public_id: str) -> Invitation:
    invitation = invitation_list(organization=organization).filter(public_id=public_id).first()
    if invitation is None:
        raise ObjectNotFound(f"Invitation {public_id!r} not found.")
    return invitation


def owner_emails(*, organization: Organization) -> list[str]:
    return [m.user.email for m in membership_list(organization=organization, role="owner") if m.user.email]


def user_get_by_email(*, email: str):
    return get_user_model().objects.filter(email__iexact=email.strip()).select_related("membership").first()


def audit_event_list(*, organization: Organization, action: str | None = None) -> QuerySet[AuditEvent]:
    events = organization_rows(AuditEvent, organization=organization)
    events = where_given(events, action=action)
    return events.order_by("-created_at", "-id")
