"""`manage.py bootstrap --json`: the catalog, fleets and (with --demo) a demo tenant for the launcher.

Idempotent on the catalog; fleet tokens are rotated on every run because only their hashes are
stored, so the launcher can only learn them by asking for new ones.
"""

import json

from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from controlplane.catalog.models import FleetRole, Model
from controlplane.catalog.services import fleet_ensure, fleet_token_rotate, model_ensure
from controlplane.tenancy.services import api_key_create, organization_ensure

DEFAULT_MODEL_NAME = "diptych-tiny"
DEFAULT_CONTEXT_LENGTH = 1024
DEFAULT_FAMILY = "llama"
DEFAULT_DTYPE = "float32"
LOCAL_REGION = "local"
LOCAL_HARDWARE_CLASS = "cpu"
DEMO_ORGANIZATION_NAME = "Demo"
DEMO_ORGANIZATION_SLUG = "demo"
DEMO_API_KEY_NAME = "demo"


def fleet_name(*, model_name: str, role: str) -> str:
    """`diptych-tiny` gives `tiny-prefill`, `tiny-decode`, `tiny-colocated`; other models keep their name."""
    return f"{model_name.removeprefix('diptych-')}-{role}"


class Command(BaseCommand):
    help = "Ensure the model catalog and its local fleets, issue fresh fleet tokens, and optionally a demo API key."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the JSON object on one line, for programs.")
        parser.add_argument(
            "--demo", action="store_true", help="Ensure the Demo organization and issue it a new API key."
        )
        parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="Name of the model to serve.")
        parser.add_argument("--source", help="builtin:<name> or a local model directory (default builtin:<model>).")
        parser.add_argument("--context-length", type=int, default=DEFAULT_CONTEXT_LENGTH)
        parser.add_argument("--family", default=DEFAULT_FAMILY)
        parser.add_argument("--dtype", default=DEFAULT_DTYPE)

    def handle(self, *args, **options) -> None:
        with transaction.atomic():
            model = model_ensure(
                name=options["model"],
                source=options["source"] or f"builtin:{options['model']}",
                context_length=options["context_length"],
                family=options["family"],
                dtype=options["dtype"],
            )
            result = {"fleet_tokens": self._issue_fleet_tokens(model=model)}
            if options["demo"]:
                organization = organization_ensure(name=DEMO_ORGANIZATION_NAME, slug=DEMO_ORGANIZATION_SLUG)
                issued = api_key_create(organization=organization, name=DEMO_API_KEY_NAME)
                result = {"api_key": issued.key, "organization_id": organization.public_id, **result}

        self.stderr.write(f"Model {model.name} ({model.source}) and its {LOCAL_REGION} fleets are ready.")
        self.stdout.write(json.dumps(result, indent=None if options["json"] else 2))

    def _issue_fleet_tokens(self, *, model: Model) -> dict[str, str]:
        tokens = {}
        for role in FleetRole.values:
            fleet = fleet_ensure(
                name=fleet_name(model_name=model.name, role=role),
                role=role,
                model=model,
                region=LOCAL_REGION,
                hardware_class=LOCAL_HARDWARE_CLASS,
            )
            tokens[role] = fleet_token_rotate(fleet=fleet)
        return tokens
