"""Webhook deliveries over https: the receiver's certificate must chain to the configured authorities and
name the URL's host, whichever of the host's addresses the delivery connects to. The receiver serves TLS on
loopback with a certificate of a test authority made here (DIPTYCH_WEBHOOKS_CA_BUNDLE names it, as an
operator names its own CA)."""

import datetime
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from controlplane.webhooks.delivery import try_delivery
from controlplane.webhooks.models import WebhookDelivery
from controlplane.webhooks.services import emit_event
from tests.platform.test_webhooks_delivery import subscribe
from tests.platform.webhook_receiver import Receiver


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, issuer: str, key, signing_key, *, ca: bool, dns_name: str | None = None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if dns_name is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _pem(certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


@pytest.fixture
def authority(tmp_path, settings):
    """A test certificate authority, trusted by the webhook sender; yields a function that makes a server
    context whose certificate names `dns_name`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("Diptych test CA", "Diptych test CA", ca_key, ca_key, ca=True)
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(_pem(ca))
    settings.DIPTYCH_WEBHOOKS_CA_BUNDLE = str(bundle)
    settings.DIPTYCH_WEBHOOKS_ALLOW_HTTP = False
    settings.DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS = ["127.0.0.0/8", "::1/128"]

    def server_context(dns_name: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = _certificate(dns_name, "Diptych test CA", key, ca_key, ca=False, dns_name=dns_name)
        chain, key_file = tmp_path / f"{dns_name}.pem", tmp_path / f"{dns_name}.key"
        chain.write_bytes(_pem(leaf))
        pkcs8 = serialization.PrivateFormat.PKCS8
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption()))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(Path(chain), Path(key_file))
        return context

    return server_context


def test_a_delivery_over_https_to_a_receiver_whose_certificate_names_its_host_arrives(client_a, org_a, authority):
    with Receiver(tls=authority("localhost")) as receiver:
        subscribe(client_a, receiver)
        event = emit_event(organization=org_a, event_type="batch.completed", data={"id": "batch_tls"})
        delivery = try_delivery(WebhookDelivery.objects.get(event=event).id)
        assert delivery is not None and delivery.status == "delivered", list(delivery.attempt_log.values("error"))
        (handed_on,) = receiver.application
        assert handed_on.type == "batch.completed" and handed_on.data.id == "batch_tls"


def test_a_receiver_whose_certificate_names_another_host_gets_nothing(client_a, org_a, authority):
    with Receiver(tls=authority("elsewhere.example")) as receiver:
        subscribe(client_a, receiver)
        event = emit_event(organization=org_a, event_type="batch.completed", data={"id": "batch_tls"})
        delivery = try_delivery(WebhookDelivery.objects.get(event=event).id)
        assert delivery is not None and delivery.status == "pending" and delivery.attempts == 1
        (attempt,) = delivery.attempt_log.all()
        assert attempt.status_code is None and "CERTIFICATE_VERIFY_FAILED" in attempt.error
        assert receiver.tries == []
