"""`manage.py bootstrap --json`: the catalog, fleets and (with --demo) a demo tenant for the launcher.

The fleets are one per role in one region and hardware class: `local` and `cpu` unless --region and
--hardware-class say otherwise; run it once per region (and hardware class) that has workers.

Idempotent on the catalog; fleet tokens are rotated on every run because only their hashes are
stored, so the launcher can only learn them by asking for new ones. With --credentials-file (deployments
that run bootstrap on every start, such as infra/compose.yaml) the tokens, key and password kept in that
file are reused while they still work, and the file holds what the run printed.
"""

import json
import os
import re
import secrets
from datetime import UTC, datetime
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from controlplane.catalog.models import Model, PricePhase, PriceTier
from controlplane.catalog.services import (
    LOCAL_HARDWARE_CLASS,
    LOCAL_REGION,
    fleet_tokens_issue,
    model_ensure,
    price_ensure_initial,
)
from controlplane.common.errors import CredentialRejected
from controlplane.tenancy.models import Membership, Role, Scope
from controlplane.tenancy.selectors import user_get_by_email
from controlplane.tenancy.services import (
    api_key_authenticate,
    api_key_create,
    member_add,
    organization_ensure,
    user_ensure,
)

DEFAULT_MODEL_NAME = "diptych-tiny"
DEFAULT_CONTEXT_LENGTH = 1024
DEFAULT_FAMILY = "llama"
DEFAULT_DTYPE = "float32"
# A region or hardware class becomes part of fleet names and metric labels: a short word, no spaces.
PLACEMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
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


class Command(BaseCommand):
    help = (
        "Ensure the model catalog and its fleets in one region (local unless --region), issue fresh fleet tokens, "
        "and optionally a demo API key."
    )

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
        parser.add_argument(
            "--region",
            default=LOCAL_REGION,
            help=f"Region of the fleets (default {LOCAL_REGION}); other regions' fleet names end in -<region>.",
        )
        parser.add_argument(
            "--hardware-class",
            default=LOCAL_HARDWARE_CLASS,
            help=f"Hardware class of the fleets (default {LOCAL_HARDWARE_CLASS}); others end in -<class>.",
        )
        parser.add_argument("--staff-email", help="Create (or reset the password of) a staff user with this email.")
        parser.add_argument("--staff-password", help="Password of the staff user (required with --staff-email).")
        parser.add_argument(
            "--credentials-file",
            type=Path,
            help="Reuse the fleet tokens, demo API key and password kept in this JSON file while they still work, "
            "and keep what this run prints there (readable by its owner only).",
        )

    def handle(self, *args, **options) -> None:
        if bool(options["staff_email"]) != bool(options["staff_password"]):
            raise CommandError("--staff-email and --staff-password go together.")
        for option in ("region", "hardware_class"):
            if not PLACEMENT_NAME.fullmatch(options[option]):
                raise CommandError(
                    f"--{option.replace('_', '-')} {options[option]!r} must be 1 to 64 letters, digits, '.', '_' "
                    "or '-', starting with a letter or digit."
                )
        kept = _read_kept(options["credentials_file"])
        with transaction.atomic():
            model = model_ensure(
                name=options["model"],
                source=options["source"] or f"builtin:{options['model']}",
                context_length=options["context_length"],
                family=options["family"],
                dtype=options["dtype"],
            )
            fleet_tokens = fleet_tokens_issue(
                model=model,
                region=options["region"],
                hardware_class=options["hardware_class"],
                kept=kept.get("fleet_tokens", {}),
            )
            result: dict[str, object] = {"fleet_tokens": fleet_tokens}
            self._seed_prices()
            if options["demo"]:
                organization = organization_ensure(name=DEMO_ORGANIZATION_NAME, slug=DEMO_ORGANIZATION_SLUG)
                api_key = _kept_api_key(kept.get("api_key"), organization=organization) or (
                    api_key_create(organization=organization, name=DEMO_API_KEY_NAME, scopes=Scope.values).key
                )
                result = {
                    "api_key": api_key,
                    "organization_id": organization.public_id,
                    **result,
                    "dashboard_email": DEMO_OWNER_EMAIL,
                    "dashboard_password": self._ensure_demo_owner(
                        organization=organization, kept=kept.get("dashboard_password")
                    ),
                }
            if options["staff_email"]:
                user_ensure(email=options["staff_email"], password=options["staff_password"], is_staff=True)
                result["staff_email"] = options["staff_email"]

        self.stderr.write(
            f"Model {model.name} ({model.source}) and its {options['region']} {options['hardware_class']} fleets "
            "are ready."
        )
        if options["credentials_file"]:
            _keep(options["credentials_file"], result)
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

    def _ensure_demo_owner(self, *, organization, kept: str | None) -> str:
        """A fresh password each run (only its hash is stored, so it can only be learnt by resetting it),
        unless the kept one still signs the demo owner in."""
        user = user_get_by_email(email=DEMO_OWNER_EMAIL)
        if kept and user is not None and user.check_password(kept):
            password = kept
        else:
            password = secrets.token_urlsafe(12)
            user = user_ensure(email=DEMO_OWNER_EMAIL, password=password)
        if not Membership.objects.filter(user=user).exists():
            member_add(organization=organization, email=DEMO_OWNER_EMAIL, role=Role.OWNER)
        return password


def _read_kept(path: Path | None) -> dict:
    """What an earlier run kept in the credentials file; nothing when there is no such file yet."""
    if path is None or not path.exists():
        return {}
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CommandError(f"--credentials-file {path} is not a JSON object bootstrap wrote: {error}") from None
    if not isinstance(kept, dict):
        raise CommandError(f"--credentials-file {path} is not a JSON object bootstrap wrote.")
    return kept


def _kept_api_key(key: str | None, *, organization) -> str | None:
    """The kept demo key, while it is live and still the demo organization's."""
    if not key:
        return None
    try:
        api_key = api_key_authenticate(key=key)
    except CredentialRejected:
        return None
    return key if api_key.organization_id == organization.id else None


def _keep(path: Path, result: dict) -> None:
    """Writes the file whole (a reader never sees half of it), readable by its owner only."""
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump(result, file)
    os.replace(partial, path)
