"""The one way to read an organization's rows: a queryset that cannot be built without an organization."""

from django.db.models import Model, QuerySet

from controlplane.tenancy.models import Organization


def organization_rows(model: type[Model], *, organization: Organization, field: str = "organization") -> QuerySet:
    """`model`'s rows that belong to `organization`; refuses anything but a saved Organization."""
    if not isinstance(organization, Organization) or organization.pk is None:
        raise TypeError(f"{model.__name__} rows can only be read for a saved Organization, got {organization!r}.")
    return model.objects.filter(**{field: organization})
