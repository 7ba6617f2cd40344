from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0005_idempotency_response_as_text"),
    ]

    operations = [
        migrations.AddField(
            model_name="idempotencyrecord",
            name="caller",
            field=models.CharField(
                default="",
                help_text="Who made the request and with what authority; only it gets the answer.",
                max_length=160,
            ),
        ),
    ]
