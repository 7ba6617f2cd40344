import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tenancy", "0007_default_projects"),
    ]

    operations = [
        migrations.AlterField(
            model_name="apikey",
            name="project",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="api_keys", to="tenancy.project"
            ),
        ),
    ]
