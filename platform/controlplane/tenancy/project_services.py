from collections.abc import Mapping

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.common.errors import InvalidInput
from controlplane.tenancy.access import SYSTEM, Principal
from controlplane.tenancy.models import (
    Membership,
    Organization,
    Project,
    ProjectMembership,
    ProjectRole,
)
from controlplane.tenancy.project_selectors import project_check_role
from controlplane.tenancy.services import RATE_LIMIT_FIELDS, audit_record, project_default_ensure

PROJECT_SETTINGS = ("name", *RATE_LIMIT_FIELDS, "spend_limit_micros")


def _check_live(project: Project) -> None:
    if project.archived_at is not None:
        raise InvalidInput(f"Project {project.public_id} is archived.", error_type="project_archived")


@transaction.atomic
def project_create(
    *, organization: Organization, name: str, settings: Mapping[str, object] | None = None, actor: Principal = SYSTEM
) -> Project:
    project_default_ensure(organization=organization)  # a new organization's first project is not its default
    project = Project.objects.create(organization=organization, name=name, **_checked_settings(settings or {}))
    audit_record(
        actor=actor,
        organization=organization,
        action="project.create",
        target_type="project",
        target_id=project.public_id,
        details={"project_id": project.public_id, "name": name, **(settings or {})},
    )
    return project


def _checked_settings(changes: Mapping[str, object]) -> dict[str, object]:
    unknown = sorted(set(changes) - set(PROJECT_SETTINGS))
    if unknown:
        raise InvalidInput(
            f"Not a project setting: {', '.join(unknown)}.",
            fields={name: ["Not a project setting."] for name in unknown},
        )
    return dict(changes)


@transaction.atomic
def project_update(*, project: Project, changes: Mapping[str, object], actor: Principal = SYSTEM) -> Project:
    """Rename the project or set its limits (None: unlimited); the gateway reads the limits when it next
    verifies a key of the project, within its key cache time."""
    project_check_role(project=project, actor=actor, roles=frozenset({ProjectRole.OWNER}), doing="change a project")
    _check_live(project)
    changes = _checked_settings(changes)
    if not changes:
        raise InvalidInput(f"Give at least one of {', '.join(PROJECT_SETTINGS)}.")
    previous = {name: getattr(project, name) for name in changes}
    for name, value in changes.items():
        setattr(project, name, value)
    project.save(update_fields=list(changes))
    audit_record(
        actor=actor,
        organization=project.organization,
        action="project.update",
        target_type="project",
        target_id=project.public_id,
        details={"project_id": project.public_id, "from": previous, "to": dict(changes)},
    )
    return project


@transaction.atomic
def project_archive(*, project: Project, actor: Principal = SYSTEM) -> Project:
    """Archive the project: its keys stop authenticating, its usage stays. Archiving it again changes nothing."""
    project_check_role(project=project, actor=actor, roles=frozenset({ProjectRole.OWNER}), doing="archive a project")
    if project.is_default:
        raise InvalidInput("The default project cannot be archived.", error_type="default_project")
    archived = Project.objects.filter(pk=project.pk, archived_at__isnull=True).update(archived_at=timezone.now())
    project.refresh_from_db(fields=["archived_at"])
    if archived:
        audit_record(
            actor=actor,
            organization=project.organization,
            action="project.archive",
            target_type="project",
            target_id=project.public_id,
            details={"project_id": project.public_id},
        )
    return project


@transaction.atomic
def project_member_add(
    *, project: Project, membership: Membership, role: str, actor: Principal = SYSTEM
) -> ProjectMembership:
    """Give a member of the project's organization a role in the project."""
    project_check_role(project=project, actor=actor, roles=frozenset({ProjectRole.OWNER}), doing="add members")
    _check_live(project)
    if membership.organization_id != project.organization_id:
        raise InvalidInput(
            "Only members of the project's organization can join it.", fields={"member_id": ["Unknown."]}
        )
    try:
        with transaction.atomic():
            project_membership = ProjectMembership.objects.create(project=project, membership=membership, role=role)
    except IntegrityError:
        raise InvalidInput(
            f"{membership.user.email} is already a member of this project.", error_type="already_member"
        ) from None
    _audit_member(project_membership, action="project.member_add", actor=actor, details={"role": role})
    return project_membership


@transaction.atomic
def project_member_set_role(
    *, project_membership: ProjectMembership, role: str, actor: Principal = SYSTEM
) -> ProjectMembership:
    project = project_membership.project
    project_check_role(project=project, actor=actor, roles=frozenset({ProjectRole.OWNER}), doing="change members")
    previous = project_membership.role
    project_membership.role = role
    project_membership.save(update_fields=["role"])
    _audit_member(
        project_membership, action="project.member_set_role", actor=actor, details={"from": previous, "to": role}
    )
    return project_membership


@transaction.atomic
def project_member_remove(*, project_membership: ProjectMembership, actor: Principal = SYSTEM) -> None:
    project = project_membership.project
    project_check_role(project=project, actor=actor, roles=frozenset({ProjectRole.OWNER}), doing="remove members")
    _audit_member(
        project_membership, action="project.member_remove", actor=actor, details={"role": project_membership.role}
    )
    project_membership.delete()


def _audit_member(project_membership: ProjectMembership, *, action: str, actor: Principal, details: dict) -> None:
    project = project_membership.project
    audit_record(
        actor=actor,
        organization=project.organization,
        action=action,
        target_type="project_member",
        target_id=project_membership.public_id,
        details={"project_id": project.public_id, "email": project_membership.membership.user.email, **details},
    )
