"""Each ledger row recorded before projects existed belongs to its API key's project (the key's
organization's default project, tenancy 0007)."""

from django.db import migrations
from django.db.models import OuterRef, Subquery


def project_from_key(apps, schema_editor):
    UsageEvent = apps.get_model("metering", "UsageEvent")
    ApiKey = apps.get_model("tenancy", "ApiKey")
    key_project = ApiKey.objects.filter(pk=OuterRef("api_key_id")).values("project_id")[:1]
    UsageEvent.objects.filter(project__isnull=True).update(project_id=Subquery(key_project))


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0008_usageevent_project"),
    ]

    operations = [
        migrations.RunPython(project_from_key, migrations.RunPython.noop),
    ]
