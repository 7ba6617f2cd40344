from django.contrib import admin

from controlplane.tenancy.models import ApiKey, AuditEvent, Membership, Organization


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "public_id", "created_at"]
    search_fields = ["name", "slug", "public_id"]
    readonly_fields = ["public_id", "created_at"]
    prepopulated_fields = {"slug": ["name"]}


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are issued through the API, which shows the secret once; staff can inspect and revoke them."""

    list_display = [
        "name",
        "prefix",
        "organization",
        "scopes",
        "created_at",
        "last_used_at",
        "revoked_at",
        "expires_at",
    ]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "public_id", "organization__name"]
    readonly_fields = ["public_id", "organization", "name", "prefix", "key_hash", "created_at", "last_used_at"]
    fields = [
        *readonly_fields,
        "scopes",
        "revoked_at",
        "expires_at",
        "requests_per_minute",
        "input_tokens_per_minute",
        "output_tokens_per_minute",
    ]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "organization", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["user__email", "organization__name"]


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """The audit log is append-only."""

    list_display = ["created_at", "organization", "actor", "action", "target_type", "target_id"]
    list_filter = ["action"]
    search_fields = ["actor", "target_id"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
