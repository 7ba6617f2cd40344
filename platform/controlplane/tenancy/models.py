from django.conf import settings
from django.db import models
from django.utils.deconstruct import deconstructible

from controlplane.common.ids import PUBLIC_ID_MAX_LENGTH, new_public_id


def new_organization_id() -> str:
    return new_public_id("org")


def new_api_key_id() -> str:
    return new_public_id("key")


def new_membership_id() -> str:
    return new_public_id("mem")


def new_invitation_id() -> str:
    return new_public_id("inv")


def new_audit_event_id() -> str:
    return new_public_id("aud")


def new_project_id() -> str:
    return new_public_id("proj")


def new_project_membership_id() -> str:
    return new_public_id("pmem")


class Role(models.TextChoices):
    OWNER = "owner"
    ADMIN = "admin"
    DEVELOPER = "developer"
    BILLING_VIEWER = "billing_viewer"


class ProjectRole(models.TextChoices):
    OWNER = "owner"  # manages the project's members, keys and limits
    MEMBER = "member"  # uses the project: its keys (their own), usage and batches
    VIEWER = "viewer"  # reads the project and its usage


class Scope(models.TextChoices):
    INFERENCE = "inference"
    ADMIN_READ = "admin:read"
    ADMIN_WRITE = "admin:write"


class ApiKeyKind(models.TextChoices):
    STANDARD = "standard"
    BATCH_RUNNER = "batch_runner"  # a batch's own key: it sends that batch's lines, and nothing else


class RateLimits(models.Model):
    """Per-minute limits the gateway enforces; null means unlimited."""

    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    input_tokens_per_minute = models.PositiveBigIntegerField(null=True, blank=True)
    output_tokens_per_minute = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        abstract = True


@deconstructible
class DefaultRateLimit:
    """A new organization's limit, read from settings.DIPTYCH_DEFAULT_RATE_LIMITS when it is created."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> int | None:
        return settings.DIPTYCH_DEFAULT_RATE_LIMITS[self.name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DefaultRateLimit) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class Organization(RateLimits):
    # An organization starts with the default limits; its API keys start unlimited (the organization's apply).
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, default=DefaultRateLimit("requests_per_minute")
    )
    input_tokens_per_minute = models.PositiveBigIntegerField(
        null=True, blank=True, default=DefaultRateLimit("input_tokens_per_minute")
    )
    output_tokens_per_minute = models.PositiveBigIntegerField(
        null=True, blank=True, default=DefaultRateLimit("output_tokens_per_minute")
    )
    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_organization_id, editable=False
    )
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    spend_limit_micros = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Spend cap per billing period in micro-dollars; null is no cap."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.public_id})"


DEFAULT_PROJECT_NAME = "Default project"


class Project(RateLimits):
    """A unit of an organization that API keys are issued in and usage is counted by, with limits of its own
    (the gateway applies the tightest of key, project and organization). Every organization has one default
    project, which keys go to when no other is named; a project is archived, never deleted."""

    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_project_id, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="projects")
    name = models.CharField(max_length=200)
    is_default = models.BooleanField(default=False)
    spend_limit_micros = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Spend cap per billing period in micro-dollars; null is no cap."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    archived_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["organization"], condition=models.Q(is_default=True), name="tenancy_project_one_default"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.public_id})"


class Membership(models.Model):
    """A user's place in an organization; a user belongs to at most one organization."""

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_membership_id, editable=False
    )
    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership")
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.user} in {self.organization.name} as {self.role}"


class ProjectMembership(models.Model):
    """A member's role in one project of their organization. Owners and admins of the organization need none:
    they act on every project as its owner."""

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_project_membership_id, editable=False
    )
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    membership = models.ForeignKey(Membership, on_delete=models.CASCADE, related_name="project_memberships")
    role = models.CharField(max_length=20, choices=ProjectRole.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "membership"], name="tenancy_projectmembership_one_per_member")
        ]

    def __str__(self) -> str:
        return f"{self.membership.user} in {self.project.name} as {self.role}"


class Invitation(models.Model):
    """An offer of membership to an email, accepted with the one-time token sent to that address."""

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_invitation_id, editable=False
    )
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField(max_length=254)
    role = models.CharField(max_length=20, choices=Role.choices)
    token_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the token; never the token.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.email} to {self.organization.name} as {self.role}"


class ApiKey(RateLimits):
    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_api_key_id, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="api_keys")
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="The first characters of the key, to recognise it in lists.")
    key_hash = models.CharField(
        max_length=64, unique=True, help_text="SHA-256 of the full key; the key itself is never stored."
    )
    scopes = models.JSONField(default=list, help_text="Subset of inference, admin:read, admin:write.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="api_keys"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    kind = models.CharField(
        max_length=16,
        choices=ApiKeyKind.choices,
        default=ApiKeyKind.STANDARD,
        help_text="batch_runner: created by a batch for its own lines; left out of the key lists unless asked for.",
    )

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class AuditEvent(models.Model):
    """An administrative action: who did what to which object, when. Append-only."""

    public_id = models.CharField(
        max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_audit_event_id, editable=False
    )
    organization = models.ForeignKey(
        Organization,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="audit_events",
        help_text="Null for platform-wide actions by staff (e.g. draining a worker).",
    )
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    actor = models.CharField(max_length=300, help_text="The user's email or the key's id, kept if either is deleted.")
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=64)
    target_id = models.CharField(max_length=64)
    details = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.actor} {self.action} {self.target_type}:{self.target_id}"
