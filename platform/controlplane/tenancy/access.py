"""Who may do what: roles of members, scopes of API keys, and the principal every request acts as.

The permission table (docs/control-plane.md repeats it):

| permission          | owner | admin | developer  | billing_viewer | key admin:read | key admin:write |
| organization:read   | yes   | yes   | yes        | yes            | yes            |                 |
| catalog:read        | yes   | yes   | yes        | yes            | yes            |                 |
| usage:read          | yes   | yes   | yes        | yes            | yes            |                 |
| billing:read        | yes   | yes   |            | yes            | yes            |                 |
| keys:read           | yes   | yes   | own keys   |                | yes            |                 |
| keys:write          | yes   | yes   | own keys   |                |                | yes             |
| members:read        | yes   | yes   |            |                | yes            |                 |
| members:write       | yes   | yes   |            |                |                | yes             |
| spend_limit:write   | yes   | yes   |            |                |                | yes             |
| limits:read         | yes   | yes   | yes        | yes            | yes            |                 |
| limits:write        | yes   | yes   |            |                |                | yes             |
| audit:read          | yes   |       |            |                |                |                 |
| batches:read        | yes   | yes   | yes        |                | yes            |                 |
| batches:write       | yes   | yes   | yes        |                |                | yes             |
| webhooks:read       | yes   | yes   |            |                | yes            |                 |
| webhooks:write      | yes   | yes   |            |                |                | yes             |
| projects:read       | yes   | yes   | theirs     | theirs         | yes            |                 |
| projects:write      | yes   | yes   |            |                |                | yes             |

"theirs": the default project and the projects they are a member of (tenancy.project_access), where their
project role decides what they may change.

A key with the inference scope also holds batches:read and batches:write: the Batch API is inference.

Staff users (is_staff) additionally manage fleets, workers and prices, which belong to no organization.
"""

from dataclasses import dataclass, field
from enum import StrEnum

from django.contrib.auth.models import AbstractUser

from controlplane.tenancy.models import ApiKey, Organization, Role, Scope


class Permission(StrEnum):
    ORGANIZATION_READ = "organization:read"
    CATALOG_READ = "catalog:read"
    USAGE_READ = "usage:read"
    BILLING_READ = "billing:read"
    KEYS_READ = "keys:read"
    KEYS_WRITE = "keys:write"
    MEMBERS_READ = "members:read"
    MEMBERS_WRITE = "members:write"
    SPEND_LIMIT_WRITE = "spend_limit:write"
    LIMITS_READ = "limits:read"  # rate limits of the organization and its keys
    LIMITS_WRITE = "limits:write"
    AUDIT_READ = "audit:read"
    BATCHES_READ = "batches:read"
    BATCHES_WRITE = "batches:write"
    WEBHOOKS_READ = "webhooks:read"  # an organization's webhook endpoints and their deliveries
    WEBHOOKS_WRITE = "webhooks:write"
    PROJECTS_READ = "projects:read"  # members see only their projects; owners, admins and admin keys see all
    PROJECTS_WRITE = "projects:write"


_EVERYONE = {
    Permission.ORGANIZATION_READ,
    Permission.CATALOG_READ,
    Permission.USAGE_READ,
    Permission.LIMITS_READ,
    Permission.PROJECTS_READ,
}
_ADMIN = set(Permission) - {Permission.AUDIT_READ}

ROLE_PERMISSIONS: dict[str, frozenset[Permission]] = {
    Role.OWNER: frozenset(Permission),
    Role.ADMIN: frozenset(_ADMIN),
    Role.DEVELOPER: frozenset(
        _EVERYONE | {Permission.KEYS_READ, Permission.KEYS_WRITE, Permission.BATCHES_READ, Permission.BATCHES_WRITE}
    ),
    Role.BILLING_VIEWER: frozenset(_EVERYONE | {Permission.BILLING_READ}),
}

SCOPE_PERMISSIONS: dict[str, frozenset[Permission]] = {
    Scope.INFERENCE: frozenset({Permission.BATCHES_READ, Permission.BATCHES_WRITE}),
    Scope.ADMIN_READ: frozenset(p for p in _ADMIN if p.endswith(":read")),
    Scope.ADMIN_WRITE: frozenset(p for p in _ADMIN if p.endswith(":write")),
}

# Scopes a member may put on a key they create; a key may hand out inference and the scopes it holds.
ROLE_GRANTABLE_SCOPES: dict[str, frozenset[str]] = {
    Role.OWNER: frozenset(Scope.values),
    Role.ADMIN: frozenset(Scope.values),
    Role.DEVELOPER: frozenset({Scope.INFERENCE, Scope.ADMIN_READ}),
    Role.BILLING_VIEWER: frozenset(),
}

# Roles each role may give to (or take from) members; nobody but an owner touches an owner.
ROLE_MANAGEABLE_ROLES: dict[str, frozenset[str]] = {
    Role.OWNER: frozenset(Role.values),
    Role.ADMIN: frozenset({Role.ADMIN, Role.DEVELOPER, Role.BILLING_VIEWER}),
}


@dataclass(frozen=True)
class Principal:
    """The caller of a public endpoint: a signed-in user or an API key, within at most one organization."""

    organization: Organization | None
    user: AbstractUser | None = None  # the Django user of a session
    api_key: ApiKey | None = None
    role: str | None = None
    permissions: frozenset[Permission] = field(default_factory=frozenset)
    is_authenticated = True

    @classmethod
    def of_api_key(cls, api_key: ApiKey) -> "Principal":
        permissions = frozenset().union(*(SCOPE_PERMISSIONS.get(scope, frozenset()) for scope in api_key.scopes))
        return cls(organization=api_key.organization, api_key=api_key, permissions=permissions)

    @classmethod
    def of_user(cls, user: AbstractUser) -> "Principal":
        membership = getattr(user, "membership", None)
        if membership is None:
            return cls(organization=None, user=user)
        return cls(
            organization=membership.organization,
            user=user,
            role=membership.role,
            permissions=ROLE_PERMISSIONS[membership.role],
        )

    @property
    def authority(self) -> str:
        """Who this is and what it may do: equal for two requests only when one caller, holding the same
        authority, made both. A key's scopes never change, so its id says both (the gateway names a key
        the same way)."""
        if self.api_key is not None:
            return f"api_key:{self.api_key.public_id}"
        user_id = self.user.pk if self.user is not None else None
        return f"user:{user_id} role:{self.role} staff:{self.is_staff}"

    @property
    def is_staff(self) -> bool:
        return bool(self.user is not None and self.user.is_staff)

    @property
    def limited_to_own_keys(self) -> bool:
        return self.role == Role.DEVELOPER

    @property
    def grantable_scopes(self) -> frozenset[str]:
        if self.api_key is not None:
            return frozenset(self.api_key.scopes) | {Scope.INFERENCE}
        if self.role is None:
            return frozenset()
        return ROLE_GRANTABLE_SCOPES.get(self.role, frozenset())

    @property
    def manageable_roles(self) -> frozenset[str]:
        if self.api_key is not None:
            return ROLE_MANAGEABLE_ROLES[Role.ADMIN]
        if self.role is None:
            return frozenset()
        return ROLE_MANAGEABLE_ROLES.get(self.role, frozenset())

    @property
    def label(self) -> str:
        if self.user is not None:
            return self.user.email or self.user.get_username()
        if self.api_key is not None:
            return f"api_key:{self.api_key.public_id}"
        return "system"

    def can(self, permission: Permission) -> bool:
        return permission in self.permissions


SYSTEM = Principal(organization=None)
