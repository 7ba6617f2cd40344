from django.contrib import admin

from controlplane.catalog.models import Fleet, Model, ModelFile, Price, Worker


class ModelFileInline(admin.TabularInline):
    """Published files are immutable: `diptych model register` adds them; here they are read."""

    model = ModelFile
    fields = ["revision", "path", "size", "sha256", "created_at"]
    readonly_fields = fields
    ordering = ["-created_at", "path"]
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "family", "dtype", "context_length", "source", "revision", "created_at"]
    search_fields = ["name", "source"]
    readonly_fields = ["revision"]
    inlines = [ModelFileInline]


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    """Prices are added through the API (staff), which refuses to rewrite the past; here they are read."""

    list_display = ["model", "phase", "micros_per_million", "effective_from", "created_at"]
    list_filter = ["phase", "model"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Fleet)
class FleetAdmin(admin.ModelAdmin):
    """Tokens are issued by `manage.py bootstrap`, which shows them once; the hash is never displayed."""

    list_display = ["name", "role", "model", "region", "hardware_class", "created_at"]
    list_filter = ["role", "region", "hardware_class"]
    search_fields = ["name"]


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    """Workers manage their own rows through registration and heartbeats; staff only look."""

    list_display = [
        "name",
        "public_id",
        "fleet",
        "address",
        "state",
        "revision",
        "drain_requested_at",
        "last_heartbeat_at",
        "queue_depth",
        "kv_blocks_free",
    ]
    list_filter = ["state", "fleet"]
    search_fields = ["name", "public_id", "address"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
