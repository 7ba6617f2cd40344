"""What the chaos run reads and writes in the control plane's database itself, through `manage.py shell`:
a second organization with a key of its own, and afterwards the whole usage ledger and each batch's runner
key, as they are stored (every organization's at once; no API shows a batch's runner key)."""

import json
import subprocess
import sys

from bench.chaos.ledger import LedgerEvent
from diptych_server.stack import REPO_ROOT, Stack, StackError

CREATE_ORGANIZATION = """
import json
from controlplane.tenancy.models import Scope
from controlplane.tenancy.services import api_key_create, organization_ensure
organization = organization_ensure(name={name!r}, slug={slug!r})
issued = api_key_create(organization=organization, name="chaos", scopes=Scope.values)
print(json.dumps({{"organization_id": organization.public_id, "api_key": issued.key}}))
"""

READ_LEDGER = """
import json
from controlplane.metering.models import UsageEvent
rows = UsageEvent.objects.values_list(
    "request_id", "phase", "organization__public_id", "tokens", "api_key__public_id", "tier", "client_request_id"
)
print(json.dumps([list(row) for row in rows]))
"""

READ_RUNNER_KEYS = """
import json
from controlplane.batches.models import Batch
print(json.dumps(dict(Batch.objects.values_list("public_id", "runner_key__public_id"))))
"""


def create_organization(stack: Stack, name: str, slug: str) -> tuple[str, str]:
    """A second organization with an API key of its own: (organization id, key)."""
    created = json.loads(django_shell(stack, CREATE_ORGANIZATION.format(name=name, slug=slug)))
    return created["organization_id"], created["api_key"]


def read_ledger(stack: Stack) -> list[LedgerEvent]:
    """Every usage event in the control plane's database, whichever organization it is billed to."""
    return [LedgerEvent(*row) for row in json.loads(django_shell(stack, READ_LEDGER))]


def read_runner_keys(stack: Stack) -> dict[str, str]:
    """Batch id -> the public id of its runner key, for every batch."""
    return json.loads(django_shell(stack, READ_RUNNER_KEYS))


def django_shell(stack: Stack, code: str) -> str:
    """Runs code in the control plane's Django environment; returns the last line it printed."""
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=REPO_ROOT,
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise StackError(f"manage.py shell failed:\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]
