"""Every organization gets its default project, and every API key moves into its organization's default
project."""

from django.db import migrations

DEFAULT_PROJECT_NAME = "Default project"  # tenancy.models.DEFAULT_PROJECT_NAME when this was written


def create_default_projects(apps, schema_editor):
    Organization = apps.get_model("tenancy", "Organization")
    Project = apps.get_model("tenancy", "Project")
    ApiKey = apps.get_model("tenancy", "ApiKey")
    new_project_id = Project._meta.get_field("public_id").default
    for organization in Organization.objects.filter(projects__isnull=True).iterator():
        Project.objects.create(
            organization=organization, name=DEFAULT_PROJECT_NAME, is_default=True, public_id=new_project_id()
        )
    for project in Project.objects.filter(is_default=True).iterator():
        ApiKey.objects.filter(organization_id=project.organization_id, project__isnull=True).update(project=project)


def clear_projects(apps, schema_editor):
    ApiKey = apps.get_model("tenancy", "ApiKey")
    ApiKey.objects.update(project=None)


class Migration(migrations.Migration):
    dependencies = [
        ("tenancy", "0006_projects"),
    ]

    operations = [
        migrations.RunPython(create_default_projects, clear_projects),
    ]
