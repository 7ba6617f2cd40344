from django.contrib import admin

from controlplane.metering.models import UsageEvent


@admin.register(UsageEvent)
class UsageEventAdmin(admin.ModelAdmin):
    """The ledger is append-only: staff can read it, never edit it."""

    list_display = ["request_id", "phase", "organization", "model", "tokens", "cached_tokens", "started_at"]
    list_filter = ["phase", "model", "region"]
    search_fields = ["request_id", "worker_id"]
    list_select_related = ["organization"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
