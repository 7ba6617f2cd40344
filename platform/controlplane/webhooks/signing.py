"""An event's body in OpenAI's webhook event shape and its Standard Webhooks headers (`webhook-id`,
`webhook-timestamp`, `webhook-signature`), signed by the `standardwebhooks` package: what the official
`openai` client's `webhooks.unwrap(body, headers, secret=...)` verifies and parses."""

import base64
import calendar
import json
import math
import secrets
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook

from controlplane.webhooks.models import WebhookEndpoint, WebhookEvent

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def secret_hint(secret: str) -> str:
    """Enough of a secret to tell which one a receiver holds, never enough to sign with."""
    return f"{SECRET_PREFIX}…{secret[-4:]}"


def unix(moment: datetime) -> int:
    return calendar.timegm(moment.utctimetuple())


def event_body(event: WebhookEvent) -> bytes:
    """The same bytes on every try: built from the stored event alone, as ASCII-escaped JSON."""
    payload = {
        "id": event.public_id,
        "object": "event",
        "type": event.type,
        "created_at": unix(event.created_at),
        "data": event.data,
    }
    return json.dumps(payload, separators=(",", ":")).encode("ascii")


def signing_secrets(endpoint: WebhookEndpoint, now: datetime) -> list[str]:
    """The endpoint's secret, and during the overlap after a rotation the one before it."""
    keys = [endpoint.secret]
    if endpoint.previous_secret and endpoint.previous_secret_until and now < endpoint.previous_secret_until:
        keys.append(endpoint.previous_secret)
    return keys


def signed_headers(*, event: WebhookEvent, body: bytes, keys: list[str], now: datetime) -> dict[str, str]:
    """The headers of one try: its own timestamp (receivers refuse old ones), one signature per secret."""
    moment = now.astimezone(UTC)
    text = body.decode("ascii")
    signatures = [Webhook(key).sign(msg_id=event.public_id, timestamp=moment, data=text) for key in keys]
    return {
        "webhook-id": event.public_id,
        "webhook-timestamp": str(math.floor(moment.timestamp())),
        "webhook-signature": " ".join(signatures),
    }
