"""`manage.py bootstrap --json`: the catalog, fleets and (with --demo) a demo tenant for the launcher.

Idempotent on the catalog; fleet tokens are rotated on every run because only their hashes are
stored, so the launcher can only learn them by asking for new ones.
"""

import json
import secrets
from datetime import UTC, datetime

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from controlplane.catalog.models import FleetRole, Model, PricePhase, PriceTier
from controlplane.catalog.services import fleet_ensure, fleet_token_rotate, model_ensure, price_ensure_initial
from controlplane.tenancy.models import Membership, Role, Scope
from controlplane.tenancy.services import api_key_create, member_add, organization_ensure, user_ensure

DEFAULT_MODEL_NAME = "diptych-tiny"
DEFAULT_CONTEXT_LENGTH = 1024
DEFAULT_FAMILY = "llama"
DEFAULT_DTYPE = "float32"
LOCAL_REGION = "local"
LOCAL_HARDWARE_CLASS = "cpu"
DEMO_ORGANIZATION_NAME = "Demo"
DEMO_ORGANIZATION_SLUG = "demo"
DEMO_API_KEY_NAME = "demo"
DEMO_OWNER_EMAIL = "demo@diptych.local"
# Seeded list prices in micro-dollars per million tokens, from the beginning of time (a first price may
# start in the past; later changes cannot).
DEMO_PRICES = {
    "diptych-tiny": {PricePhase.PREFILL: 100_000, PricePhase.CACHED_PREFILL: 25_000, PricePhase.DECODE: 400_000},
    "diptych-100m": {PricePhase.PREFILL: 200_000, PricePhase.CACHED_PREFILL: 50_000, PricePhase.DECODE: 800_000},
}
PRICES_EFFECTIVE_FROM = datetime(2020, 1, 1, tzinfo=UTC)
BATCH_DISCOUNT_PERCENT = 50  # the Batch API's requests run in spare capacity, at half the list price


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
        parser.add_argument("--staff-email", help="Create (or reset the password of) a staff user with this email.")
        parser.add_argument("--staff-password", help="Password of the staff user (required with --staff-email).")

    def handle(self, *args, **options) -> None:
        if bool(options["staff_email"]) != bool(options["staff_password"]):
            raise CommandError("--staff-email and --staff-password go together.")
        with transaction.atomic():
            model = model_ensure(
                name=options["model"],
                source=options["source"] or f"builtin:{options['model']}",
                context_length=options["context_length"],
                family=options["family"],
                dtype=options["dtype"],
            )
            result: dict[str, object] = {"fleet_tokens": self._issue_fleet_tokens(model=model)}
            self._seed_prices()
            if options["demo"]:
                organization = organization_ensure(name=DEMO_ORGANIZATION_NAME, slug=DEMO_ORGANIZATION_SLUG)
                issued = api_key_create(organization=organization, name=DEMO_API_KEY_NAME, scopes=Scope.values)
                result = {
                    "api_key": issued.key,
                    "organization_id": organization.public_id,
                    **result,
                    "dashboard_email": DEMO_OWNER_EMAIL,
                    "dashboard_password": self._ensure_demo_owner(organization=organization),
                }
            if options["staff_email"]:
                user_ensure(email=options["staff_email"], password=options["staff_password"], is_staff=True)
                result["staff_email"] = options["staff_email"]

        self.stderr.write(f"Model {model.name} ({model.source}) and its {LOCAL_REGION} fleets are ready.")
        self.stdout.write(json.dumps(result, indent=None if options["json"] else 2))

    def _seed_prices(self) -> None:
        for model in Model.objects.filter(name__in=DEMO_PRICES):
            for phase, micros in DEMO_PRICES[model.name].items():
                price_ensure_initial(
                    model=model, phase=phase, micros_per_million=micros, effective_from=PRICES_EFFECTIVE_FROM
                )
                price_ensure_initial(
                    model=model,
                    phase=phase,
                    tier=PriceTier.BATCH,
                    micros_per_million=micros * (100 - BATCH_DISCOUNT_PERCENT) // 100,
                    effective_from=PRICES_EFFECTIVE_FROM,
                )

    def _ensure_demo_owner(self, *, organization) -> str:
        """A fresh password each run: only its hash is stored, so it can only be learnt by resetting it."""
        password = secrets.token_urlsafe(12)
        user = user_ensure(email=DEMO_OWNER_EMAIL, password=password)
        if not Membership.objects.filter(user=user).exists():
            member_add(organization=organization, email=DEMO_OWNER_EMAIL, role=Role.OWNER)
        return password

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
