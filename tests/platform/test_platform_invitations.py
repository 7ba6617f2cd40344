"""Adding a member is an invitation: its answer never tells whether an email belongs to another organization."""

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from rest_framework.test import APIClient

from controlplane.tenancy.models import Invitation, Membership
from controlplane.tenancy.services import member_add, user_ensure

PASSWORD = "correct-horse-battery-staple"
ACCEPT_URL = "/api/v1/auth/accept-invitation"
VOLATILE_FIELDS = {"id", "email", "created_at", "expires_at"}


@pytest.fixture
def owner_a(org_a) -> APIClient:
    membership = member_add(organization=org_a, email="owner@acme.test", role="owner", password=PASSWORD)
    client = APIClient()
    client.force_login(membership.user)
    return client


@pytest.fixture
def bravo_member(org_b):
    return member_add(organization=org_b, email="taken@bravo.test", role="admin", password="bravo-own-password-1")


def invite(client: APIClient, email: str, role: str = "developer"):
    return client.post("/api/v1/members", {"email": email, "role": role}, format="json")


def token_mailed_to(email: str) -> str:
    (message,) = [message for message in mail.outbox if message.to == [email]]
    return re.search(r"inv_[0-9A-Za-z]{38}", message.body).group(0)


def accept(token: str, password: str = PASSWORD):
    return APIClient().post(ACCEPT_URL, {"token": token, "password": password}, format="json")


def test_the_answer_is_the_same_for_a_new_email_and_one_of_another_organization(org_a, owner_a, bravo_member):
    user_ensure(email="orphan@elsewhere.test", password="orphan-own-password-1")
    emails = ("new@acme.test", "taken@bravo.test", "orphan@elsewhere.test")
    answers = {email: invite(owner_a, email) for email in emails}

    assert {email: answer.status_code for email, answer in answers.items()} == dict.fromkeys(answers, 201)
    shapes = {
        email: {k: v for k, v in answer.data.items() if k not in VOLATILE_FIELDS} for email, answer in answers.items()
    }
    assert list(shapes.values()) == [{"role": "developer", "status": "invited"}] * 3
    assert [sorted(answer.data) for answer in answers.values()] == [sorted(answers["new@acme.test"].data)] * 3
    assert sorted(mail.outbox[i].to[0] for i in range(3)) == sorted(answers)
    # Nothing of the other organization changed, and no account was created or changed.
    bravo_member.refresh_from_db()
    assert (bravo_member.organization.slug, bravo_member.role) == ("bravo", "admin")
    assert bravo_member.user.check_password("bravo-own-password-1")
    assert not get_user_model().objects.filter(email="new@acme.test").exists()
    assert Membership.objects.filter(organization=org_a).count() == 1


def test_a_new_invitee_accepts_with_a_password_of_their_own(org_a, owner_a):
    invite(owner_a, "New@Acme.test", role="admin")
    response = accept(token_mailed_to("new@acme.test"))
    assert response.status_code == 200, response.data
    assert response.data["user"]["organization"]["id"] == org_a.public_id
    assert response.data["user"]["role"] == "admin"
    assert Membership.objects.get(user__email="new@acme.test").organization == org_a
    assert not Invitation.objects.exists()
    assert accept(token_mailed_to("new@acme.test")).data["error"]["type"] == "invitation_invalid"
    logged_in = APIClient().post("/api/v1/auth/login", {"email": "new@acme.test", "password": PASSWORD}, format="json")
    assert logged_in.status_code == 200


def test_a_member_of_another_organization_cannot_accept_and_nothing_changes(org_a, owner_a, bravo_member):
    invite(owner_a, "taken@bravo.test")
    token = token_mailed_to("taken@bravo.test")
    wrong = accept(token, password=PASSWORD)
    assert wrong.status_code == 401 and wrong.data["error"]["type"] == "invalid_credentials"
    refused = accept(token, password="bravo-own-password-1")
    assert refused.status_code == 400 and refused.data["error"]["type"] == "already_member"
    assert "leave it" in refused.data["error"]["message"]
    assert Membership.objects.get(user=bravo_member.user).organization.slug == "bravo"
    assert Invitation.objects.filter(organization=org_a, email="taken@bravo.test").exists()


def test_an_existing_account_without_organization_accepts_with_its_password(org_a, owner_a):
    user = user_ensure(email="orphan@elsewhere.test", password="orphan-own-password-1")
    invite(owner_a, "orphan@elsewhere.test")
    assert accept(token_mailed_to("orphan@elsewhere.test"), password="orphan-own-password-1").status_code == 200
    assert Membership.objects.get(user=user).organization == org_a


@pytest.mark.parametrize("token", ["inv_" + "0" * 38, "not-a-token", ""])
def test_an_unknown_token_is_refused(db, token):
    response = accept(token)
    assert response.status_code in (400, 401)
    assert not get_user_model().objects.exists()


def test_an_expired_or_revoked_invitation_is_refused(org_a, owner_a):
    invite(owner_a, "late@acme.test")
    created_at = Invitation.objects.get().created_at
    Invitation.objects.filter(email="late@acme.test").update(expires_at=created_at - timedelta(1))
    assert owner_a.get("/api/v1/invitations").data["data"][0]["status"] == "expired"
    assert accept(token_mailed_to("late@acme.test")).status_code == 401

    invitation = invite(owner_a, "gone@acme.test").data
    assert owner_a.delete(f"/api/v1/invitations/{invitation['id']}").status_code == 204
    assert accept(token_mailed_to("gone@acme.test")).status_code == 401
    assert not get_user_model().objects.filter(email__in=["late@acme.test", "gone@acme.test"]).exists()


def test_a_password_in_the_invitation_is_a_400_that_changes_nothing(org_a, owner_a):
    body = {"email": "x@acme.test", "role": "developer", "password": PASSWORD}
    response = owner_a.post("/api/v1/members", body, format="json")
    assert response.status_code == 400
    assert "remove this field" in response.data["error"]["fields"]["password"][0]
    assert not Invitation.objects.exists() and not mail.outbox


def test_inviting_a_member_of_this_organization_is_a_400(org_a, owner_a):
    response = invite(owner_a, "OWNER@acme.test")
    assert response.status_code == 400 and response.data["error"]["type"] == "already_member"
    assert not Invitation.objects.exists()


def test_a_weak_password_on_acceptance_is_a_400_and_the_invitation_stays(org_a, owner_a):
    invite(owner_a, "weak@acme.test")
    response = accept(token_mailed_to("weak@acme.test"), password="123")
    assert response.status_code == 400 and "password" in response.data["error"]["fields"]
    assert Invitation.objects.filter(email="weak@acme.test").exists()
    assert not get_user_model().objects.filter(email="weak@acme.test").exists()
