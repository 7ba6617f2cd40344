import django.db.models.deletion
from django.db import migrations, models

import controlplane.tenancy.models


class Migration(migrations.Migration):
    dependencies = [
        ("tenancy", "0005_apikey_kind"),
    ]

    operations = [
        migrations.CreateModel(
            name="Project",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("requests_per_minute", models.PositiveIntegerField(blank=True, null=True)),
                ("input_tokens_per_minute", models.PositiveBigIntegerField(blank=True, null=True)),
                ("output_tokens_per_minute", models.PositiveBigIntegerField(blank=True, null=True)),
                (
                    "public_id",
                    models.CharField(
                        default=controlplane.tenancy.models.new_project_id, editable=False, max_length=32, unique=True
                    ),
                ),
                ("name", models.CharField(max_length=200)),
                ("is_default", models.BooleanField(default=False)),
                (
                    "spend_limit_micros",
                    models.PositiveBigIntegerField(
                        blank=True,
                        help_text="Spend cap per billing period in micro-dollars; null is no cap.",
                        null=True,
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("archived_at", models.DateTimeField(blank=True, null=True)),
                (
                    "organization",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="projects",
                        to="tenancy.organization",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("is_default", True)),
                        fields=("organization",),
                        name="tenancy_project_one_default",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="ProjectMembership",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "public_id",
                    models.CharField(
                        default=controlplane.tenancy.models.new_project_membership_id,
                        editable=False,
                        max_length=32,
                        unique=True,
                    ),
                ),
                (
                    "role",
                    models.CharField(
                        choices=[("owner", "Owner"), ("member", "Member"), ("viewer", "Viewer")], max_length=20
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "membership",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="project_memberships",
                        to="tenancy.membership",
                    ),
                ),
                (
                    "project",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="memberships", to="tenancy.project"
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("project", "membership"), name="tenancy_projectmembership_one_per_member"
                    )
                ],
            },
        ),
        # Nullable until 0007 has put every key in its organization's default project; 0008 requires it.
        migrations.AddField(
            model_name="apikey",
            name="project",
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.PROTECT, related_name="api_keys", to="tenancy.project"
            ),
        ),
    ]
