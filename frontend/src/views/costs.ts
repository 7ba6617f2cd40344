import { get } from "../api";
import { COST, pivot, usageChart } from "../charts";
import { count, dollarsExact, h, isoDay, periodText, table, usd, when } from "../format";
import type { PeriodCosts } from "../types";

export const PHASES: Record<string, string> = { prefill: "Prefill", cached_prefill: "Cached prefill", decode: "Decode" };
const DAY_MS = 86_400_000;

// Every day from the period's first (or an earlier day that late usage was billed on) to today or its last.
function periodDays(costs: PeriodCosts): string[] {
  const last = Math.min(Date.parse(`${costs.period_end}T00:00:00Z`) - DAY_MS, Date.now());
  const days: string[] = [];
  for (let day = Date.parse(`${costs.period_start}T00:00:00Z`); day <= last; day += DAY_MS) days.push(isoDay(new Date(day)));
  return [...new Set([...costs.data.map((row) => row.day), ...days])].sort();
}

function csvField(value: string | number): string {
  const text = String(value);
  return /[",\r\n]/.test(text) ? `"${text.replaceAll('"', '""')}"` : text;
}

// The usage of the period as CSV: a line per day × model × phase × tier, with its tokens and cost in dollars.
export function usageCsv(costs: PeriodCosts): string {
  const lines = [
    ["day", "model", "phase", "tier", "tokens", "cost_usd"],
    ...costs.data.map((row) => [row.day, row.model, row.phase, row.tier, row.tokens, dollarsExact(row.amount_micros)]),
  ];
  return lines.map((fields) => fields.map(csvField).join(",")).join("\r\n") + "\r\n";
}

function csvButton(costs: PeriodCosts): HTMLElement {
  const button = h("button", { type: "button", class: "secondary", "data-export": "csv" }, "Download CSV");
  button.addEventListener("click", () => {
    const link = h("a", {
      href: URL.createObjectURL(new Blob([usageCsv(costs)], { type: "text/csv" })),
      download: `diptych-usage-${costs.period_start.slice(0, 7)}.csv`,
    });
    link.click();
    window.setTimeout(() => URL.revokeObjectURL(link.href), 0);
  });
  return button;
}

// What the open period's usage costs so far: by phase, by day (chart and table), and as a CSV file.
export async function costsView(): Promise<HTMLElement> {
  const costs = await get<PeriodCosts>("/billing/current/costs");
  const period = h("p", { class: "muted", "data-period": "" },
    `${periodText(costs.period_start, costs.period_end)} · usage counted until ${when(costs.as_of)}`);
  if (costs.data.length === 0) {
    return h("div", { "data-empty": "costs" }, period,
      h("p", { class: "empty" }, h("strong", {}, "No usage yet this period. "),
        "Send a request with one of your API keys (below); its prefill and decode tokens show here, priced, within a minute."));
  }
  const byPhase = table(
    ["Phase", "Tokens", "Cost"],
    [
      ...costs.phases.map((phase) => [PHASES[phase.phase] ?? phase.phase, count(phase.tokens), usd(phase.amount_micros)]),
      [h("strong", {}, "Total"), count(costs.phases.reduce((sum, phase) => sum + phase.tokens, 0)), h("strong", {}, usd(costs.total_micros))],
    ],
    { "data-table": "phase-costs" },
  );
  const rows = costs.data.map((row) => ({ day: row.day, key: row.phase, amount_micros: row.amount_micros }));
  const chart = usageChart("cost", "Cost per day by phase",
    pivot(rows, periodDays(costs), (key) => PHASES[key] ?? key, Object.keys(PHASES), (row) => row.amount_micros), COST);
  return h("div", {}, period, h("div", { class: "charts" }, h("div", {}, byPhase,
    h("p", { class: "muted" }, "Batch API requests are rated at the batch price; the CSV file has a line per day, model, phase and tier."),
    h("p", {}, csvButton(costs))), chart));
}
