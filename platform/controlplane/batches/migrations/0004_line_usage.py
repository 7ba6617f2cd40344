from django.db import migrations, models

from controlplane.batches.models import answer_usage


def usage_of_lines_answered_before(apps, schema_editor):
    """Lines that succeeded before their usage was kept get it from their stored answers."""
    BatchLine = apps.get_model("batches", "BatchLine")
    for line in BatchLine.objects.filter(state="succeeded").only("id", "response").iterator():
        BatchLine.objects.filter(id=line.id).update(**answer_usage(line.response))


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0003_revoke_ended_batches_runner_keys"),
    ]

    operations = [
        migrations.AddField(
            model_name="batchline",
            name="input_tokens",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="batchline",
            name="cached_tokens",
            field=models.PositiveIntegerField(default=0, help_text="Of the input tokens, those cached."),
        ),
        migrations.AddField(
            model_name="batchline",
            name="output_tokens",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.RunPython(usage_of_lines_answered_before, migrations.RunPython.noop),
    ]
