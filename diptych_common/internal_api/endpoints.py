"""Every endpoint of the internal API that a caller names, once: the method it is called with and its path.

A test (tests/platform/test_platform_internal_contracts.py) finds each in the control plane's OpenAPI
schema with that method, so an endpoint renamed or removed there and not here fails it.
"""

from dataclasses import dataclass
from urllib.parse import quote

PREFIX = "/api/v1/internal"


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # `{name}` stands for a path parameter, as the control plane's schema writes it

    def url(self, **parameters: str) -> str:
        """The path with each `{name}` set to its parameter, percent-encoded."""
        return self.path.format(**{name: quote(value, safe="") for name, value in parameters.items()})


# The gateway's, with the internal token (the KV tier asks for the worker credential too).
API_KEY_VERIFY = Endpoint("POST", PREFIX + "/api-keys/verify")
REGISTRY = Endpoint("GET", PREFIX + "/registry")
WORKER_CREDENTIAL = Endpoint("GET", PREFIX + "/worker-credential")
USAGE_EVENTS = Endpoint("POST", PREFIX + "/usage-events")
RATE_LIMIT_REFUSALS = Endpoint("POST", PREFIX + "/rate-limit-refusals")
IDEMPOTENCY_KEY_CLAIM = Endpoint("POST", PREFIX + "/idempotency-keys/claim")
IDEMPOTENCY_KEY_COMPLETE = Endpoint("POST", PREFIX + "/idempotency-keys/complete")
IDEMPOTENCY_KEY_RELEASE = Endpoint("POST", PREFIX + "/idempotency-keys/release")
RESPONSE_STORE = Endpoint("POST", PREFIX + "/responses")
RESPONSE_FETCH = Endpoint("GET", PREFIX + "/responses/{response_id}")
RESPONSE_DELETE = Endpoint("DELETE", PREFIX + "/responses/{response_id}")
RESPONSE_STATUS = Endpoint("GET", PREFIX + "/responses/{response_id}/status")
RESPONSE_CANCEL = Endpoint("POST", PREFIX + "/responses/{response_id}/cancel")
RESPONSE_INPUT_ITEMS = Endpoint("GET", PREFIX + "/responses/{response_id}/input-items")
MODEL_ARTIFACT_MANIFEST = Endpoint("GET", PREFIX + "/artifacts/models/{model}/manifest")
MODEL_ARTIFACT_FILE = Endpoint("GET", PREFIX + "/artifacts/models/{model}/files/{revision}/{path}")

# The workers', with their fleet's token. The files of the fleet's model are at the URL its manifest names.
WORKER_REGISTER = Endpoint("POST", PREFIX + "/workers/register")
WORKER_HEARTBEAT = Endpoint("POST", PREFIX + "/workers/{worker_id}/heartbeat")
ARTIFACT_MANIFEST = Endpoint("GET", PREFIX + "/artifacts/manifest")

# The command line's, with the internal token.
MODEL_REGISTER = Endpoint("POST", PREFIX + "/models/register")
