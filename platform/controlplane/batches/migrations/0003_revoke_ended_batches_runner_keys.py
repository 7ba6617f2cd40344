from django.db import migrations
from django.utils import timezone

ENDED = ["completed", "failed", "expired", "cancelled"]


def revoke_runner_keys_of_ended_batches(apps, schema_editor):
    """A batch's runner key is revoked when the batch ends; this revokes those of batches that ended before."""
    ApiKey = apps.get_model("tenancy", "ApiKey")
    ApiKey.objects.filter(batch__status__in=ENDED, revoked_at__isnull=True).update(revoked_at=timezone.now())


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0002_line_sent_at"),
        ("tenancy", "0003_invitations"),
    ]

    operations = [migrations.RunPython(revoke_runner_keys_of_ended_batches, migrations.RunPython.noop)]
