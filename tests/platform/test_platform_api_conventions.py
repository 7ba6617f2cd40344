import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.test import Client
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient, APIRequestFactory
from rest_framework.views import APIView

from controlplane.billing.models import BillingPeriod, Invoice, SpendAlert
from controlplane.catalog.models import Fleet, Model, Price, Worker
from controlplane.metering.models import UsageEvent
from controlplane.tenancy.models import ApiKey, AuditEvent, Membership, Organization


def test_schema_is_served_without_credentials(db):
    response = APIClient().get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    for path in [
        "/api/v1/usage/summary",
        "/api/v1/usage/daily",
        "/api/v1/billing/current",
        "/api/v1/spend-limit",
        "/api/v1/invoices/{invoice_id}",
        "/api/v1/auth/login",
        "/api/v1/audit-log",
        "/api/v1/stripe/webhook",
    ]:
        assert path in schema["paths"]


def test_unknown_api_paths_answer_the_error_shape(client_a):
    response = client_a.get("/api/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"


def test_invalid_json_answers_the_error_shape(client_a):
    response = client_a.post("/api/v1/api-keys", data="{not json", content_type="application/json")
    assert response.status_code == 400
    assert response.data["error"]["type"] == "parse_error"


def test_wrong_method_answers_the_error_shape(client_a):
    response = client_a.delete("/api/v1/organization")
    assert response.status_code == 405
    assert response.data["error"]["type"] == "method_not_allowed"


class RaisingApi(APIView):
    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes = [AllowAny]
    error = Exception("set by as_view")

    def get(self, request: Request) -> Response:
        raise self.error


@pytest.mark.parametrize(
    ("error", "status_code", "error_type"),
    [(Http404("No such thing."), 404, "not_found"), (PermissionDenied("Not yours."), 403, "permission_denied")],
)
def test_django_errors_raised_in_a_view_answer_the_error_shape(error, status_code, error_type):
    response = RaisingApi.as_view(error=error)(APIRequestFactory().get("/api/v1/anything"))
    assert response.status_code == status_code
    assert response.data == {"error": {"type": error_type, "message": str(error)}}


ADMIN_MODELS = [
    Organization,
    Membership,
    ApiKey,
    AuditEvent,
    Model,
    Price,
    Fleet,
    Worker,
    UsageEvent,
    BillingPeriod,
    Invoice,
    SpendAlert,
]


@pytest.mark.parametrize("model", ADMIN_MODELS)
def test_admin_lists_every_model_for_staff_only(db, model):
    url = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
    anonymous = Client().get(url)
    assert anonymous.status_code == 302
    assert "/admin/login/" in anonymous["Location"]

    staff = get_user_model().objects.create_user("staff", password="pw-irrelevant", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    assert client.get(url).status_code == 200


def test_every_operation_documents_the_error_shape(db):
    schema = APIClient().get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert schema["components"]["schemas"]["Error"]["required"] == ["error"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert operation["responses"]["default"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/Error"
            }, f"{method} {path}"


@pytest.mark.parametrize("query", [{"limit": "lots"}, {"limit": 0}, {"limit": 1001}, {"offset": -1}, {"offset": "x"}])
def test_malformed_pagination_is_refused(client_a, query):
    response = client_a.get("/api/v1/api-keys", query)
    assert response.status_code == 400
    assert set(response.data["error"]["fields"]) == set(query)


def test_pagination_envelope(client_a, key_a):
    response = client_a.get("/api/v1/api-keys", {"limit": 1, "offset": 0})
    assert response.data == {"object": "list", "data": [response.data["data"][0]], "has_more": False, "total": 1}


def test_empty_filter_value_is_refused(client_a):
    response = client_a.get("/api/v1/invoices", {"status": ""})
    assert response.status_code == 400
    assert response.data["error"]["fields"] == {"status": ["Must not be empty."]}
