"""Projects: /api/v1/projects, their members and their API keys."""

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.common.filters import QueryFilterSerializer
from controlplane.common.limits import MAX_BIG_INTEGER
from controlplane.common.pagination import PaginatedListMixin
from controlplane.common.strict_input import StrictInputSerializer, TextField, WholeNumberField
from controlplane.tenancy.access import Permission
from controlplane.tenancy.apis import (
    MAX_REQUESTS_PER_MINUTE,
    MAX_TOKENS_PER_MINUTE,
    ApiKeyListCreateApi,
    ApiKeyOutputSerializer,
    RateLimitsOutputSerializer,
)
from controlplane.tenancy.base_apis import TenantAPIView
from controlplane.tenancy.models import Project, ProjectRole
from controlplane.tenancy.project_selectors import (
    project_api_key_list,
    project_get,
    project_list,
    project_membership_get,
    project_membership_list,
)
from controlplane.tenancy.project_services import (
    project_archive,
    project_create,
    project_member_add,
    project_member_remove,
    project_member_set_role,
    project_update,
)
from controlplane.tenancy.selectors import membership_get
from controlplane.tenancy.services import api_key_create

# DRF refuses NUL in any text; saying so in the schema makes the refusal a documented one.
NO_NUL = RegexValidator(r"^[^\x00]*$", "Null characters are not allowed.")


class ProjectOutputSerializer(serializers.Serializer):
    object = serializers.SerializerMethodField()
    id = serializers.CharField(source="public_id")
    name = serializers.CharField()
    is_default = serializers.BooleanField()
    status = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    archived_at = serializers.DateTimeField(allow_null=True)
    limits = RateLimitsOutputSerializer(source="*")
    spend_limit_micros = serializers.IntegerField(
        allow_null=True, help_text="Micro-dollars per billing period; null is no cap."
    )

    def get_object(self, project: Project) -> str:
        return "organization.project"

    def get_status(self, project: Project) -> str:
        return "archived" if project.archived_at is not None else "active"


class ProjectSettingsInputSerializer(StrictInputSerializer):
    """A project's name and limits; a null limit is unlimited, 0 refuses every request."""

    name = TextField(max_length=200, required=False, validators=[NO_NUL])
    requests_per_minute = WholeNumberField(
        min_value=0, max_value=MAX_REQUESTS_PER_MINUTE, allow_null=True, required=False
    )
    input_tokens_per_minute = WholeNumberField(
        min_value=0, max_value=MAX_TOKENS_PER_MINUTE, allow_null=True, required=False
    )
    output_tokens_per_minute = WholeNumberField(
        min_value=0, max_value=MAX_TOKENS_PER_MINUTE, allow_null=True, required=False
    )
    spend_limit_micros = WholeNumberField(min_value=0, max_value=MAX_BIG_INTEGER, allow_null=True, required=False)


class ProjectCreateInputSerializer(ProjectSettingsInputSerializer):
    name = TextField(max_length=200, validators=[NO_NUL])


class ProjectUpdateInputSerializer(ProjectSettingsInputSerializer):
    requires_a_field = True


class ProjectMemberOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    member_id = serializers.CharField(source="membership.public_id")
    email = serializers.EmailField(source="membership.user.email")
    role = serializers.ChoiceField(choices=ProjectRole.choices)
    created_at = serializers.DateTimeField()


class ProjectListCreateApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.PROJECTS_READ, "POST": Permission.PROJECTS_WRITE}

    class ProjectFilterSerializer(QueryFilterSerializer):
        include_archived = serializers.BooleanField(default=False)

    @extend_schema(parameters=[ProjectFilterSerializer], responses=ProjectOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        filters = self.ProjectFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return self.paginated_response(
            queryset=project_list(organization=self.organization, principal=self.principal, **filters.validated_data),
            serializer_class=ProjectOutputSerializer,
            request=request,
        )

    @extend_schema(request=ProjectCreateInputSerializer, responses={201: ProjectOutputSerializer})
    def post(self, request: Request) -> Response:
        serializer = ProjectCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        settings = dict(serializer.validated_data)
        name = settings.pop("name")
        project = project_create(organization=self.organization, name=name, settings=settings, actor=self.principal)
        return Response(ProjectOutputSerializer(project).data, status=status.HTTP_201_CREATED)


class ProjectDetailApi(TenantAPIView):
    required_permissions = {"GET": Permission.PROJECTS_READ, "PATCH": Permission.PROJECTS_READ}

    @extend_schema(responses=ProjectOutputSerializer)
    def get(self, request: Request, project_id: str) -> Response:
        project = project_get(organization=self.organization, public_id=project_id, principal=self.principal)
        return Response(ProjectOutputSerializer(project).data)

    @extend_schema(request=ProjectUpdateInputSerializer, responses=ProjectOutputSerializer)
    def patch(self, request: Request, project_id: str) -> Response:
        """Needs the owner role in the project (the organization's owners and admins hold it in every one)."""
        project = project_get(organization=self.organization, public_id=project_id, principal=self.principal)
        serializer = ProjectUpdateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        project = project_update(project=project, changes=serializer.validated_data, actor=self.principal)
        return Response(ProjectOutputSerializer(project).data)


class ProjectArchiveApi(TenantAPIView):
    required_permissions = {"POST": Permission.PROJECTS_READ}

    @extend_schema(request=None, responses=ProjectOutputSerializer)
    def post(self, request: Request, project_id: str) -> Response:
        """Its keys stop working at once; its usage and costs stay. Needs the owner role in the project."""
        project = project_get(organization=self.organization, public_id=project_id, principal=self.principal)
        project = project_archive(project=project, actor=self.principal)
        return Response(ProjectOutputSerializer(project).data)


class ProjectMemberListCreateApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.PROJECTS_READ, "POST": Permission.PROJECTS_READ}

    class ProjectMemberCreateInputSerializer(StrictInputSerializer):
        member_id = TextField(
            max_length=64, validators=[NO_NUL], help_text="The organization member's id (GET /api/v1/members)."
        )
        role = serializers.ChoiceField(choices=ProjectRole.choices)

    @extend_schema(responses=ProjectMemberOutputSerializer(many=True))
    def get(self, request: Request, project_id: str) -> Response:
        project = project_get(organization=self.organization, public_id=project_id, principal=self.principal)
        return self.paginated_response(
            queryset=project_membership_list(project=project),
            serializer_class=ProjectMemberOutputSerializer,
            request=request,
        )

    @extend_schema(request=ProjectMemberCreateInputSerializer, responses={201: ProjectMemberOutputSerializer})
    def post(self, request: Request, project_id: str) -> Response:
        """Needs the owner role in the project."""
        project = project_get(organization=self.organization, public_id=project_id, principal=self.principal)
        serializer = self.ProjectMemberCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        membership = membership_get(organization=self.organization, public_id=serializer.validated_data["member_id"])
        project_membership = project_member_add(
            project=project, membership=membership, role=serializer.validated_data["role"], actor=self.principal
        )
        return Response(ProjectMemberOutputSerializer(project_membership).data, status=status.HTTP_201_CREATED)


class ProjectMemberDetailApi(TenantAPIView):
    required_permissions = {
        "GET": Permission.PROJECTS_READ,
        "PATCH": Permission.PROJECTS_READ,
        "DELETE": Permission.PROJECTS_READ,
    }

    class ProjectMemberUpdateInputSerializer(StrictInputSerializer):
        role = serializers.ChoiceField(choices=ProjectRole.choices)

    def _project_membership(self, project_id: str, project_member_id: str):
        project = project_get(organization=self.organization, public_id=project_id, principal=self.principal)
        return project_membership_get(project=project, public_id=project_member_id)

    @extend_schema(responses=ProjectMemberOutputSerializer)
    def get(self, request: Request, project_id: str, project_member_id: str) -> Response:
        return Response(ProjectMemberOutputSerializer(self._project_membership(project_id, project_member_id)).data)

    @extend_schema(request=ProjectMemberUpdateInputSerializer, responses=ProjectMemberOutputSerializer)
    def patch(self, request: Request, project_id: str, project_member_id: str) -> Response:
        project_membership = self._project_membership(project_id, project_member_id)
        serializer = self.ProjectMemberUpdateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        project_membership = project_member_set_role(
            project_membership=project_membership,
            role=serializer.validated_data["role"],
            actor=self.principal,
        )
        return Response(ProjectMemberOutputSerializer(project_membership).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, project_id: str, project_member_id: str) -> Response:
        project_member_remove(
            project_membership=self._project_membership(project_id, project_member_id), actor=self.principal
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


class ProjectApiKeyListCreateApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.KEYS_READ, "POST": Permission.KEYS_WRITE}
    idempotency_withheld_fields = ("key",)

    class ProjectApiKeyCreateInputSerializer(ApiKeyListCreateApi.ApiKeyCreateInputSerializer):
        project_id = None  # the project is the one in the path

    @extend_schema(responses=ApiKeyOutputSerializer(many=True))
    def get(self, request: Request, project_id: str) -> Response:
        project = project_get(organization=self.organization, public_id=project_id, principal=self.principal)
        # Developers see only the keys they created, as in GET /api/v1/api-keys.
        own_keys_of = self.principal.user if self.principal.limited_to_own_keys else None
        return self.paginated_response(
            queryset=project_api_key_list(project=project, created_by=own_keys_of).select_related("project"),
            serializer_class=ApiKeyOutputSerializer,
            request=request,
        )

    @extend_schema(
        request=ProjectApiKeyCreateInputSerializer,
        responses={201: ApiKeyListCreateApi.ApiKeyCreatedOutputSerializer},
    )
    def post(self, request: Request, project_id: str) -> Response:
        """Needs the owner or member role in the project."""
        project = project_get(organization=self.organization, public_id=project_id, principal=self.principal)
        serializer = self.ProjectApiKeyCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = api_key_create(
            organization=self.organization, project=project, actor=self.principal, **serializer.validated_data
        )
        data = {**ApiKeyOutputSerializer(issued.api_key).data, "key": issued.key}
        return Response(data, status=status.HTTP_201_CREATED)
