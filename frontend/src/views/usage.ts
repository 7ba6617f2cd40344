import { get } from "../api";
import { usageChart, pivot } from "../charts";
import { count, h, isoDay } from "../format";
import type { ApiKey, DailyUsageRow } from "../types";
import { PHASES } from "./costs";

function lastDays(days: number): string[] {
  const today = new Date();
  return Array.from({ length: days }, (_, back) => {
    const day = new Date(Date.UTC(today.getUTCFullYear(), today.getUTCMonth(), today.getUTCDate() - (days - 1 - back)));
    return isoDay(day);
  });
}

// Charts of tokens per day by phase, by model and by API key over the last `days` days.
export async function usageView(days: number, keys: ApiKey[]): Promise<HTMLElement> {
  const range = lastDays(days);
  const query = (groupBy: string) => `/usage/daily?start=${range[0]}&end=${range[range.length - 1]}&group_by=${groupBy}`;
  const [byPhase, byModel, byKey] = await Promise.all(
    ["phase", "model", "api_key"].map((groupBy) => get<{ data: DailyUsageRow[] }>(query(groupBy)).then((body) => body.data)),
  );
  if (byPhase.length === 0) {
    return h("p", { class: "empty", "data-empty": "usage" }, h("strong", {}, `No usage in the last ${days} days. `),
      "Requests made with this organization's API keys show here by day, phase, model and key.");
  }
  const keyNames = new Map(keys.map((key) => [key.id, `${key.name} (${key.prefix})`]));
  const phaseTotal = (phase: string) => byPhase.filter((row) => row.key === phase).reduce((sum, row) => sum + row.tokens, 0);
  return h(
    "div",
    {},
    h(
      "div",
      { class: "cards" },
      ...Object.entries(PHASES).map(([phase, label]) =>
        h("div", { class: "card stat", "data-phase-total": phase }, h("span", {}, `${label} tokens`), h("strong", {}, count(phaseTotal(phase)))),
      ),
    ),
    h(
      "div",
      { class: "charts" },
      usageChart("phase", "Tokens by phase", pivot(byPhase, range, (key) => PHASES[key] ?? key, Object.keys(PHASES))),
      usageChart("model", "Tokens by model", pivot(byModel, range, (key) => key)),
      usageChart("api_key", "Tokens by API key", pivot(byKey, range, (key) => keyNames.get(key) ?? key)),
    ),
  );
}
