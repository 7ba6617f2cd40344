from django.contrib.auth import login, logout
from django.middleware.csrf import get_token
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.filters import QueryFilterSerializer
from controlplane.common.pagination import PaginatedListMixin
from controlplane.common.strict_input import StrictInputSerializer, WholeNumberField
from controlplane.common.throttles import SignInFailureThrottle, sign_in_failures_counted
from controlplane.tenancy.access import Permission, Principal
from controlplane.tenancy.authentication import MemberSessionAuthentication
from controlplane.tenancy.base_apis import PUBLIC_AUTHENTICATION, TenantAPIView
from controlplane.tenancy.models import ApiKeyKind, Role, Scope
from controlplane.tenancy.project_selectors import project_get
from controlplane.tenancy.selectors import (
    api_key_get,
    api_key_list,
    audit_event_list,
    invitation_get,
    invitation_list,
    membership_get,
    membership_list,
)
from controlplane.tenancy.services import (
    api_key_create,
    api_key_revoke,
    invitation_accept,
    invitation_revoke,
    member_invite,
    member_remove,
    member_set_role,
    rate_limits_set,
    user_authenticate,
)


class OrganizationOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    name = serializers.CharField()
    slug = serializers.CharField()
    created_at = serializers.DateTimeField()


# Bounds of a rate limit: the requests column's, and for tokens what the gateway's Redis buckets (Lua
# numbers, doubles) hold exactly.
MAX_REQUESTS_PER_MINUTE = 2**31 - 1
MAX_TOKENS_PER_MINUTE = 10**15


class RateLimitsOutputSerializer(serializers.Serializer):
    """Per-minute limits the gateway enforces; null is unlimited."""

    requests_per_minute = serializers.IntegerField(allow_null=True)
    input_tokens_per_minute = serializers.IntegerField(allow_null=True)
    output_tokens_per_minute = serializers.IntegerField(allow_null=True)


class RateLimitsInputSerializer(StrictInputSerializer):
    """Some of the per-minute limits; null makes one unlimited, 0 refuses every request."""

    requires_a_field = True

    requests_per_minute = WholeNumberField(
        min_value=0, max_value=MAX_REQUESTS_PER_MINUTE, allow_null=True, required=False
    )
    input_tokens_per_minute = WholeNumberField(
        min_value=0, max_value=MAX_TOKENS_PER_MINUTE, allow_null=True, required=False
    )
    output_tokens_per_minute = WholeNumberField(
        min_value=0, max_value=MAX_TOKENS_PER_MINUTE, allow_null=True, required=False
    )


class ApiKeyOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    project_id = serializers.CharField(source="project.public_id")
    name = serializers.CharField()
    prefix = serializers.CharField()
    scopes = serializers.ListField(child=serializers.CharField())
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    limits = RateLimitsOutputSerializer(source="*")
    kind = serializers.ChoiceField(
        choices=ApiKeyKind.choices, help_text="batch_runner: a batch's own key, made and revoked by the batch."
    )


class MemberOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    email = serializers.EmailField(source="user.email")
    role = serializers.ChoiceField(choices=Role.choices)
    created_at = serializers.DateTimeField()


class InvitationOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    email = serializers.EmailField()
    role = serializers.ChoiceField(choices=Role.choices)
    status = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()

    def get_status(self, invitation) -> str:
        return "expired" if invitation.expires_at <= timezone.now() else "invited"


class AuditEventOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    actor = serializers.CharField()
    action = serializers.CharField()
    target_type = serializers.CharField()
    target_id = serializers.CharField()
    details = serializers.DictField()
    created_at = serializers.DateTimeField()


class MeOutputSerializer(serializers.Serializer):
    class MeOrganizationSerializer(serializers.Serializer):
        id = serializers.CharField(source="public_id")
        name = serializers.CharField()

    email = serializers.CharField(allow_null=True)
    is_staff = serializers.BooleanField()
    organization = MeOrganizationSerializer(allow_null=True)
    role = serializers.CharField(allow_null=True)


def _me(principal: Principal) -> dict:
    return MeOutputSerializer(
        {
            "email": principal.user.email if principal.user is not None else None,
            "is_staff": principal.is_staff,
            "organization": principal.organization,
            "role": principal.role,
        }
    ).data


class OrganizationDetailApi(TenantAPIView):
    required_permissions = {"GET": Permission.ORGANIZATION_READ}

    @extend_schema(responses=OrganizationOutputSerializer)
    def get(self, request: Request) -> Response:
        return Response(OrganizationOutputSerializer(self.organization).data)


class ApiKeyListCreateApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.KEYS_READ, "POST": Permission.KEYS_WRITE}
    idempotency_withheld_fields = ("key",)

    class ApiKeyCreateInputSerializer(serializers.Serializer):
        name = serializers.CharField(max_length=100)
        scopes = serializers.ListField(
            child=serializers.ChoiceField(choices=Scope.choices), default=[Scope.INFERENCE], max_length=3
        )
        expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)
        project_id = serializers.CharField(
            required=False, max_length=64, help_text="The project to issue the key in; by default the default project."
        )

    class ApiKeyFilterSerializer(QueryFilterSerializer):
        kind = serializers.ChoiceField(
            choices=[*ApiKeyKind.values, "all"],
            default=ApiKeyKind.STANDARD,
            help_text="Batches' runner keys are listed with kind=batch_runner (or all), not by default.",
        )

    class ApiKeyCreatedOutputSerializer(ApiKeyOutputSerializer):
        key = serializers.CharField(
            allow_null=True,
            help_text="The full API key. It is shown only in this response: an idempotent replay of the request "
            "answers null here (header `Idempotent-Withheld: key`).",
        )

    @extend_schema(parameters=[ApiKeyFilterSerializer], responses=ApiKeyOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        filters = self.ApiKeyFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        kind = filters.validated_data["kind"]
        return self.paginated_response(
            queryset=api_key_list(
                organization=self.organization,
                created_by=_own_keys_of(self.principal),
                kind=None if kind == "all" else kind,
            ),
            serializer_class=ApiKeyOutputSerializer,
            request=request,
        )

    @extend_schema(request=ApiKeyCreateInputSerializer, responses={201: ApiKeyCreatedOutputSerializer})
    def post(self, request: Request) -> Response:
        serializer = self.ApiKeyCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        fields = dict(serializer.validated_data)
        project_id = fields.pop("project_id", None)
        if project_id is not None:
            fields["project"] = project_get(
                organization=self.organization, public_id=project_id, principal=self.principal
            )
        issued = api_key_create(organization=self.organization, actor=self.principal, **fields)
        data = {**ApiKeyOutputSerializer(issued.api_key).data, "key": issued.key}
        return Response(data, status=status.HTTP_201_CREATED)


def _own_keys_of(principal: Principal):
    """Developers see and manage only the keys they created."""
    return principal.user if principal.limited_to_own_keys else None


class ApiKeyDetailApi(TenantAPIView):
    required_permissions = {"GET": Permission.KEYS_READ}

    @extend_schema(responses=ApiKeyOutputSerializer)
    def get(self, request: Request, key_id: str) -> Response:
        api_key = api_key_get(organization=self.organization, public_id=key_id, created_by=_own_keys_of(self.principal))
        return Response(ApiKeyOutputSerializer(api_key).data)


class ApiKeyRevokeApi(TenantAPIView):
    required_permissions = {"POST": Permission.KEYS_WRITE}

    @extend_schema(request=None, responses=ApiKeyOutputSerializer)
    def post(self, request: Request, key_id: str) -> Response:
        api_key = api_key_get(organization=self.organization, public_id=key_id, created_by=_own_keys_of(self.principal))
        api_key = api_key_revoke(api_key=api_key, actor=self.principal)
        return Response(ApiKeyOutputSerializer(api_key).data)


class OrganizationLimitsApi(TenantAPIView):
    required_permissions = {"GET": Permission.LIMITS_READ, "PATCH": Permission.LIMITS_WRITE}

    class OrganizationLimitsInputSerializer(RateLimitsInputSerializer):
        refused_fields = {"spend_limit_micros": "Set the spend limit with PUT /api/v1/spend-limit."}

    class OrganizationLimitsOutputSerializer(RateLimitsOutputSerializer):
        organization_id = serializers.CharField(source="public_id")
        spend_limit_micros = serializers.IntegerField(
            allow_null=True, help_text="Micro-dollars per billing period; set it with PUT /api/v1/spend-limit."
        )

    @extend_schema(responses=OrganizationLimitsOutputSerializer)
    def get(self, request: Request) -> Response:
        return Response(self.OrganizationLimitsOutputSerializer(self.organization).data)

    @extend_schema(request=OrganizationLimitsInputSerializer, responses=OrganizationLimitsOutputSerializer)
    def patch(self, request: Request) -> Response:
        serializer = self.OrganizationLimitsInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        organization = rate_limits_set(
            holder=self.organization, changes=serializer.validated_data, actor=self.principal
        )
        return Response(self.OrganizationLimitsOutputSerializer(organization).data)


class ApiKeyLimitsApi(TenantAPIView):
    required_permissions = {"GET": Permission.LIMITS_READ, "PATCH": Permission.LIMITS_WRITE}

    class ApiKeyLimitsOutputSerializer(RateLimitsOutputSerializer):
        api_key_id = serializers.CharField(source="public_id")

    @extend_schema(responses=ApiKeyLimitsOutputSerializer)
    def get(self, request: Request, key_id: str) -> Response:
        api_key = api_key_get(organization=self.organization, public_id=key_id, created_by=_own_keys_of(self.principal))
        return Response(self.ApiKeyLimitsOutputSerializer(api_key).data)

    @extend_schema(request=RateLimitsInputSerializer, responses=ApiKeyLimitsOutputSerializer)
    def patch(self, request: Request, key_id: str) -> Response:
        api_key = api_key_get(organization=self.organization, public_id=key_id)
        serializer = RateLimitsInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        api_key = rate_limits_set(holder=api_key, changes=serializer.validated_data, actor=self.principal)
        return Response(self.ApiKeyLimitsOutputSerializer(api_key).data)


class MemberListCreateApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.MEMBERS_READ, "POST": Permission.MEMBERS_WRITE}

    class MemberCreateInputSerializer(serializers.Serializer):
        email = serializers.EmailField(max_length=254)
        role = serializers.ChoiceField(choices=Role.choices)

        def validate(self, attrs: dict) -> dict:
            if "password" in self.initial_data:
                raise serializers.ValidationError(
                    {
                        "password": [
                            "Not accepted: the invitee chooses a password when accepting the invitation; "
                            "remove this field."
                        ]
                    }
                )
            return attrs

    @extend_schema(responses=MemberOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        return self.paginated_response(
            queryset=membership_list(organization=self.organization),
            serializer_class=MemberOutputSerializer,
            request=request,
        )

    @extend_schema(request=MemberCreateInputSerializer, responses={201: InvitationOutputSerializer})
    def post(self, request: Request) -> Response:
        serializer = self.MemberCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = member_invite(organization=self.organization, actor=self.principal, **serializer.validated_data)
        return Response(InvitationOutputSerializer(issued.invitation).data, status=status.HTTP_201_CREATED)


class InvitationListApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.MEMBERS_READ}

    @extend_schema(responses=InvitationOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        return self.paginated_response(
            queryset=invitation_list(organization=self.organization),
            serializer_class=InvitationOutputSerializer,
            request=request,
        )


class InvitationDetailApi(TenantAPIView):
    required_permissions = {"DELETE": Permission.MEMBERS_WRITE}

    @extend_schema(responses={204: None})
    def delete(self, request: Request, invitation_id: str) -> Response:
        invitation = invitation_get(organization=self.organization, public_id=invitation_id)
        invitation_revoke(invitation=invitation, actor=self.principal)
        return Response(status=status.HTTP_204_NO_CONTENT)


class MemberDetailApi(TenantAPIView):
    required_permissions = {
        "GET": Permission.MEMBERS_READ,
        "PATCH": Permission.MEMBERS_WRITE,
        "DELETE": Permission.MEMBERS_WRITE,
    }

    class MemberUpdateInputSerializer(serializers.Serializer):
        role = serializers.ChoiceField(choices=Role.choices)

    @extend_schema(responses=MemberOutputSerializer)
    def get(self, request: Request, member_id: str) -> Response:
        membership = membership_get(organization=self.organization, public_id=member_id)
        return Response(MemberOutputSerializer(membership).data)

    @extend_schema(request=MemberUpdateInputSerializer, responses=MemberOutputSerializer)
    def patch(self, request: Request, member_id: str) -> Response:
        serializer = self.MemberUpdateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        membership = membership_get(organization=self.organization, public_id=member_id)
        membership = member_set_role(membership=membership, actor=self.principal, **serializer.validated_data)
        return Response(MemberOutputSerializer(membership).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, member_id: str) -> Response:
        membership = membership_get(organization=self.organization, public_id=member_id)
        member_remove(membership=membership, actor=self.principal)
        return Response(status=status.HTTP_204_NO_CONTENT)


class AuditLogApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.AUDIT_READ}

    class AuditLogFilterSerializer(QueryFilterSerializer):
        action = serializers.CharField(required=False, max_length=64)

    @extend_schema(parameters=[AuditLogFilterSerializer], responses=AuditEventOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        filters = self.AuditLogFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return self.paginated_response(
            queryset=audit_event_list(organization=self.organization, **filters.validated_data),
            serializer_class=AuditEventOutputSerializer,
            request=request,
        )


class LoginApi(APIView):
    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes = [AllowAny]
    throttle_classes = [SignInFailureThrottle]

    class LoginInputSerializer(serializers.Serializer):
        email = serializers.CharField(max_length=254)
        password = serializers.CharField(max_length=128, trim_whitespace=False)

    class LoginOutputSerializer(serializers.Serializer):
        user = MeOutputSerializer()

    @extend_schema(request=LoginInputSerializer, responses=LoginOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.LoginInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        with sign_in_failures_counted(request, self):
            user = user_authenticate(**serializer.validated_data)
        login(request._request, user)
        get_token(request._request)  # sets the csrftoken cookie the dashboard echoes in X-CSRFToken
        return Response({"user": _me(Principal.of_user(user))})


class AcceptInvitationApi(APIView):
    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes = [AllowAny]
    throttle_classes = [SignInFailureThrottle]  # it checks an account's password, as a sign-in does

    class AcceptInvitationInputSerializer(serializers.Serializer):
        token = serializers.CharField(max_length=64)
        password = serializers.CharField(
            max_length=128,
            trim_whitespace=False,
            help_text="A new password when the email has no account yet; the account's password otherwise.",
        )

    @extend_schema(request=AcceptInvitationInputSerializer, responses=LoginApi.LoginOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.AcceptInvitationInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        with sign_in_failures_counted(request, self):
            user = invitation_accept(**serializer.validated_data)
        login(request._request, user)
        get_token(request._request)
        return Response({"user": _me(Principal.of_user(user))})


class LogoutApi(APIView):
    authentication_classes = [MemberSessionAuthentication]
    permission_classes = [IsAuthenticated]

    @extend_schema(request=None, responses={204: None})
    def post(self, request: Request) -> Response:
        logout(request._request)
        return Response(status=status.HTTP_204_NO_CONTENT)


class MeApi(APIView):
    authentication_classes = PUBLIC_AUTHENTICATION
    permission_classes = [IsAuthenticated]

    @extend_schema(responses=MeOutputSerializer)
    def get(self, request: Request) -> Response:
        get_token(request._request)
        return Response(_me(request.user))


class SessionApi(APIView):
    """Whether the browser is signed in, and as whom: never an error, so that a page asking before sign-in
    logs nothing. Sets the CSRF cookie either way."""

    authentication_classes = [MemberSessionAuthentication]
    permission_classes = [AllowAny]

    class SessionOutputSerializer(serializers.Serializer):
        signed_in = serializers.BooleanField()
        user = MeOutputSerializer(allow_null=True)

    @extend_schema(responses=SessionOutputSerializer)
    def get(self, request: Request) -> Response:
        get_token(request._request)
        principal = request.user if isinstance(request.user, Principal) else None
        session = {"signed_in": principal is not None, "user": _me(principal) if principal is not None else None}
        return Response(session)
