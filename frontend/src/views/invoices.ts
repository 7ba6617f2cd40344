import { get } from "../api";
import { count, h, periodText, table, usd, usdCents } from "../format";
import type { Invoice, ListPage } from "../types";

// Invoices with their status; each one opens to show its lines.
export async function invoicesView(): Promise<HTMLElement> {
  const invoices = (await get<ListPage<Invoice>>("/invoices?limit=24")).data;
  if (invoices.length === 0) return h("p", { class: "muted" }, "No invoice yet: the first one is drafted when a billing period closes.");
  return h("div", { "data-table": "invoices" }, ...invoices.map((invoice) =>
    h("details", { class: "invoice", "data-period-start": invoice.period_start.slice(0, 10) },
      h("summary", {},
        h("span", {}, periodText(invoice.period_start, invoice.period_end)),
        h("span", { class: `badge ${invoice.status}` }, invoice.status),
        h("strong", {}, usdCents(invoice.total_cents)),
      ),
      table(
        ["Model", "Phase", "Tier", "Tokens", "Price per million", "Amount"],
        invoice.lines.map((line) => [line.model, line.phase, line.tier, count(line.tokens), usd(line.unit_price_micros_per_million), usd(line.amount_micros)]),
      ),
    ),
  ));
}
