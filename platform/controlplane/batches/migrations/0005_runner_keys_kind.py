from django.db import migrations


def mark_runner_keys(apps, schema_editor):
    """Batches' runner keys made before keys had a kind become batch_runner keys."""
    ApiKey = apps.get_model("tenancy", "ApiKey")
    ApiKey.objects.filter(batch__isnull=False).update(kind="batch_runner")


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0004_line_usage"),
        ("tenancy", "0005_apikey_kind"),
    ]

    operations = [migrations.RunPython(mark_runner_keys, migrations.RunPython.noop)]
