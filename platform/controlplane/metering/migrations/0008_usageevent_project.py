import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0007_ratelimitrefusal"),
        ("tenancy", "0008_apikey_project_required"),
    ]

    operations = [
        # Nullable until 0009 has filled it from each event's key; 0010 requires it.
        migrations.AddField(
            model_name="usageevent",
            name="project",
            field=models.ForeignKey(
                help_text="The key's project at ingest.",
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="usage_events",
                to="tenancy.project",
            ),
        ),
    ]
