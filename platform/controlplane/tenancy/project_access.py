"""A principal's role in a project of its organization, which decides what it may do there.

Owners and admins of the organization, and API keys holding admin:write, act on every project as its owner
(an admin:read key as its viewer). Developers and billing viewers act on the projects they were added to with
the role they were given there, and on the default project, which holds every key made before projects
existed, as a member (developers) or a viewer (billing viewers). Everyone else does not see the project.
"""

from controlplane.tenancy.access import Permission, Principal
from controlplane.tenancy.models import Project, ProjectRole, Role

ROLES_OVER_EVERY_PROJECT = frozenset({Role.OWNER, Role.ADMIN})
DEFAULT_PROJECT_ROLES = {Role.DEVELOPER: ProjectRole.MEMBER, Role.BILLING_VIEWER: ProjectRole.VIEWER}
# Project roles that may issue keys in the project (and manage their own there).
KEY_ISSUING_ROLES = frozenset({ProjectRole.OWNER, ProjectRole.MEMBER})


def sees_every_project(principal: Principal) -> bool:
    return principal.api_key is not None or principal.role in ROLES_OVER_EVERY_PROJECT


def project_role(*, principal: Principal, project: Project, member_role: str | None = None) -> str | None:
    """`principal`'s role in `project` (None: it does not see the project). `member_role` is the role its
    project membership gives, when the caller has read it (project_selectors.project_role_of reads it)."""
    if principal.organization is None or project.organization_id != principal.organization.pk:
        return None
    if principal.api_key is not None:
        return ProjectRole.OWNER if principal.can(Permission.PROJECTS_WRITE) else ProjectRole.VIEWER
    if principal.role in ROLES_OVER_EVERY_PROJECT:
        return ProjectRole.OWNER
    if member_role is not None:
        return member_role
    if project.is_default:
        return DEFAULT_PROJECT_ROLES.get(principal.role or "")
    return None
