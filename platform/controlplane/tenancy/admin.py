from django.contrib import admin

from controlplane.tenancy.models import ApiKey, Organization


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "public_id", "created_at"]
    search_fields = ["name", "slug", "public_id"]
    readonly_fields = ["public_id", "created_at"]
    prepopulated_fields = {"slug": ["name"]}


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are issued through the API, which shows the secret once; staff can inspect and revoke them."""

    list_display = ["name", "prefix", "organization", "created_at", "last_used_at", "revoked_at", "expires_at"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "public_id", "organization__name"]
    readonly_fields = ["public_id", "organization", "name", "prefix", "key_hash", "created_at", "last_used_at"]
    fields = [*readonly_fields, "revoked_at", "expires_at"]

    def has_add_permission(self, request) -> bool:
        return False
