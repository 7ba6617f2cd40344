from django.urls import path

from controlplane.tenancy import apis, project_apis

urlpatterns = [
    path("auth/login", apis.LoginApi.as_view(), name="auth-login"),
    path("auth/logout", apis.LogoutApi.as_view(), name="auth-logout"),
    path("auth/accept-invitation", apis.AcceptInvitationApi.as_view(), name="auth-accept-invitation"),
    path("auth/me", apis.MeApi.as_view(), name="auth-me"),
    path("auth/session", apis.SessionApi.as_view(), name="auth-session"),
    path("organization", apis.OrganizationDetailApi.as_view(), name="organization-detail"),
    path("limits", apis.OrganizationLimitsApi.as_view(), name="organization-limits"),
    path("members", apis.MemberListCreateApi.as_view(), name="member-list"),
    path("members/<str:member_id>", apis.MemberDetailApi.as_view(), name="member-detail"),
    path("invitations", apis.InvitationListApi.as_view(), name="invitation-list"),
    path("invitations/<str:invitation_id>", apis.InvitationDetailApi.as_view(), name="invitation-detail"),
    path("api-keys", apis.ApiKeyListCreateApi.as_view(), name="api-key-list"),
    path("api-keys/<str:key_id>", apis.ApiKeyDetailApi.as_view(), name="api-key-detail"),
    path("api-keys/<str:key_id>/revoke", apis.ApiKeyRevokeApi.as_view(), name="api-key-revoke"),
    path("api-keys/<str:key_id>/limits", apis.ApiKeyLimitsApi.as_view(), name="api-key-limits"),
    path("audit-log", apis.AuditLogApi.as_view(), name="audit-log"),
    path("projects", project_apis.ProjectListCreateApi.as_view(), name="project-list"),
    path("projects/<str:project_id>", project_apis.ProjectDetailApi.as_view(), name="project-detail"),
    path("projects/<str:project_id>/archive", project_apis.ProjectArchiveApi.as_view(), name="project-archive"),
    path(
        "projects/<str:project_id>/members",
        project_apis.ProjectMemberListCreateApi.as_view(),
        name="project-member-list",
    ),
    path(
        "projects/<str:project_id>/members/<str:project_member_id>",
        project_apis.ProjectMemberDetailApi.as_view(),
        name="project-member-detail",
    ),
    path(
        "projects/<str:project_id>/api_keys",
        project_apis.ProjectApiKeyListCreateApi.as_view(),
        name="project-api-key-list",
    ),
]
