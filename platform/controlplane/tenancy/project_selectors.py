from django.db.models import Q, QuerySet

from controlplane.common.errors import ObjectNotFound, PermissionRefused
from controlplane.common.querysets import where_given
from controlplane.tenancy.access import SYSTEM, Principal
from controlplane.tenancy.models import ApiKey, ApiKeyKind, Organization, Project, ProjectMembership
from controlplane.tenancy.project_access import project_role, sees_every_project
from controlplane.tenancy.scoping import organization_rows


def project_list(
    *, organization: Organization, principal: Principal | None = None, include_archived: bool = False
) -> QuerySet[Project]:
    """The organization's projects, default first; with `principal`, only those it sees (project_access)."""
    projects = organization_rows(Project, organization=organization)
    if principal is not None and not sees_every_project(principal):
        membership = getattr(principal.user, "membership", None)
        projects = projects.filter(Q(is_default=True) | Q(memberships__membership=membership))
    if not include_archived:
        projects = projects.filter(archived_at__isnull=True)
    return projects.distinct().order_by("-is_default", "created_at", "id")


def project_get(*, organization: Organization, public_id: str, principal: Principal | None = None) -> Project:
    """A project of the organization, archived ones included; ObjectNotFound when `principal` does not see it,
    as for a project of another organization."""
    project = (
        project_list(organization=organization, principal=principal, include_archived=True)
        .filter(public_id=public_id)
        .first()
    )
    if project is None:
        raise ObjectNotFound(f"Project {public_id!r} not found.")
    return project


def project_default_get(*, organization: Organization) -> Project | None:
    return organization_rows(Project, organization=organization).filter(is_default=True).first()


def project_role_of(*, principal: Principal, project: Project) -> str | None:
    """`principal`'s role in `project`, its project membership read from the database."""
    membership = getattr(principal.user, "membership", None) if principal.api_key is None else None
    member_role = None
    if membership is not None:
        member_role = (
            ProjectMembership.objects.filter(project=project, membership=membership)
            .values_list("role", flat=True)
            .first()
        )
    return project_role(principal=principal, project=project, member_role=member_role)


def project_check_role(*, project: Project, actor: Principal, roles: frozenset[str], doing: str) -> None:
    """PermissionRefused unless `actor` (SYSTEM always may) holds one of `roles` in the project."""
    if actor is SYSTEM:
        return
    if project_role_of(principal=actor, project=project) not in roles:
        needed = " or ".join(sorted(roles))
        raise PermissionRefused(f"To {doing} you need the role {needed} in project {project.public_id}.")


def project_membership_list(*, project: Project) -> QuerySet[ProjectMembership]:
    return (
        ProjectMembership.objects.filter(project=project)
        .select_related("membership__user")
        .order_by("created_at", "id")
    )


def project_membership_get(*, project: Project, public_id: str) -> ProjectMembership:
    membership = project_membership_list(project=project).filter(public_id=public_id).first()
    if membership is None:
        raise ObjectNotFound(f"Project member {public_id!r} not found.")
    return membership


def project_api_key_list(*, project: Project, created_by=None) -> QuerySet[ApiKey]:
    """The project's keys, batches' runner keys left out; with `created_by`, only those that user created."""
    api_keys = organization_rows(ApiKey, organization=project.organization).filter(
        project=project, kind=ApiKeyKind.STANDARD
    )
    api_keys = where_given(api_keys, created_by=created_by)
    return api_keys.order_by("-created_at", "-id")
