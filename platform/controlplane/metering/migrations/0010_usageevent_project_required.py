import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0009_usageevent_project_from_key"),
    ]

    operations = [
        migrations.AlterField(
            model_name="usageevent",
            name="project",
            field=models.ForeignKey(
                help_text="The key's project at ingest.",
                on_delete=django.db.models.deletion.PROTECT,
                related_name="usage_events",
                to="tenancy.project",
            ),
        ),
        migrations.AddIndex(
            model_name="usageevent",
            index=models.Index(fields=["project", "-started_at"], name="metering_us_project_35dfde_idx"),
        ),
    ]
