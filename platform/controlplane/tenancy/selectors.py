from django.db.models import QuerySet

from controlplane.common.errors import ObjectNotFound
from controlplane.tenancy.models import ApiKey, Organization


def organization_get(*, public_id: str) -> Organization:
    organization = Organization.objects.filter(public_id=public_id).first()
    if organization is None:
        raise ObjectNotFound(f"Organization {public_id!r} not found.")
    return organization


def api_key_list(*, organization: Organization) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(organization=organization).order_by("-created_at", "-id")


def api_key_get(*, organization: Organization, public_id: str) -> ApiKey:
    api_key = api_key_list(organization=organization).filter(public_id=public_id).first()
    if api_key is None:
        raise ObjectNotFound(f"API key {public_id!r} not found.")
    return api_key


def api_key_get_by_hash(*, key_hash: str) -> ApiKey | None:
    return ApiKey.objects.select_related("organization").filter(key_hash=key_hash).first()
