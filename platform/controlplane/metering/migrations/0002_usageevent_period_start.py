from datetime import date, timezone

from django.db import migrations, models


def assign_period_of_start(apps, schema_editor):
    UsageEvent = apps.get_model("metering", "UsageEvent")
    for event in UsageEvent.objects.filter(period_start__isnull=True).only("started_at").iterator():
        started = event.started_at.astimezone(timezone.utc)
        UsageEvent.objects.filter(pk=event.pk).update(period_start=date(started.year, started.month, 1))


class Migration(migrations.Migration):
    dependencies = [("metering", "0001_initial")]

    operations = [
        migrations.AddField(model_name="usageevent", name="period_start", field=models.DateField(null=True)),
        migrations.RunPython(assign_period_of_start, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="usageevent",
            name="period_start",
            field=models.DateField(
                help_text="First day of the billing period the event is billed in (see billing.periods for late events)."
            ),
        ),
        migrations.AddIndex(
            model_name="usageevent", index=models.Index(fields=["ingested_at"], name="metering_us_ingeste_c2d3a4_idx")
        ),
        migrations.AddIndex(
            model_name="usageevent",
            index=models.Index(fields=["organization", "period_start"], name="metering_us_organiz_7603a0_idx"),
        ),
    ]
