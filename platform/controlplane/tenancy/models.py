from django.db import models

from controlplane.common.ids import PUBLIC_ID_MAX_LENGTH, new_public_id


def new_organization_id() -> str:
    return new_public_id("org")


def new_api_key_id() -> str:
    return new_public_id("key")


class Organization(models.Model):
    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_organization_id, editable=False
    )
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.public_id})"


class ApiKey(models.Model):
    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_api_key_id, editable=False
    )
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="The first characters of the key, to recognise it in lists.")
    key_hash = models.CharField(
        max_length=64, unique=True, help_text="SHA-256 of the full key; the key itself is never stored."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"
