"""`manage.py invoice_preview --organization org_... --period 2026-10`: an invoice worked out line by line.

Reads the ledger and the price book exactly as closing the period would, and writes nothing.
"""

from datetime import date

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.billing.rating import allocate_cents, micros_to_cents
from controlplane.billing.services import invoice_lines_from_ledger
from controlplane.catalog.selectors import price_book
from controlplane.common.errors import ObjectNotFound
from controlplane.tenancy.selectors import organization_get


def _period(text: str) -> date:
    try:
        year, month = (int(part) for part in text.split("-"))
        return date(year, month, 1)
    except ValueError:
        raise CommandError(f"--period must look like 2026-10, got {text!r}.") from None


def _dollars(micros: int) -> str:
    return f"${micros // 1_000_000:,}.{micros % 1_000_000:06d}"


class Command(BaseCommand):
    help = "Print the invoice a billing period of an organization comes to: tokens × unit price per line, total."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--organization", required=True, help="Public id (org_...).")
        parser.add_argument("--period", required=True, help="The month, e.g. 2026-10.")

    def handle(self, *args, **options) -> None:
        try:
            organization = organization_get(public_id=options["organization"])
        except ObjectNotFound as error:
            raise CommandError(error.message) from None
        period = _period(options["period"])
        lines = invoice_lines_from_ledger(organization=organization, period_start=period, book=price_book())
        cents = allocate_cents([line.amount_micros for line in lines])
        self.stdout.write(f"Invoice preview: {organization.name} ({organization.public_id}), {period:%Y-%m}")
        header = (
            f"{'model':<16} {'phase':<15} {'tokens':>13}   {'unit price ($/M)':>16}   {'amount ($)':>15}   {'cents':>5}"
        )
        self.stdout.write(header)
        self.stdout.write("-" * len(header))
        for line, line_cents in zip(lines, cents, strict=True):
            self.stdout.write(
                f"{line.model:<16} {line.phase:<15} {line.tokens:>13,} × "
                f"{_dollars(line.unit_price_micros_per_million):>16} = "
                f"{_dollars(line.amount_micros):>15}   {line_cents:>5}"
            )
        total = sum(line.amount_micros for line in lines)
        self.stdout.write("-" * len(header))
        self.stdout.write(f"{'total':<50} {_dollars(total):>36}   {micros_to_cents(total):>5}")
        self.stdout.write(f"amount due: {micros_to_cents(total)} cents (USD {micros_to_cents(total) / 100:.2f})")
