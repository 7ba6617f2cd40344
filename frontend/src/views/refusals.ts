import { get } from "../api";
import { count, h, table, when } from "../format";
import type { RefusalRow } from "../types";
import { FIELDS } from "./limits";
import { type DayRange, rangeText } from "./range";

const SCOPES: Record<RefusalRow["scope"], string> = { organization: "Organization", api_key: "Key" };

function limitText(row: RefusalRow): string {
  const label = FIELDS.find(([field]) => field === row.limit)?.[1] ?? row.limit;
  return `${SCOPES[row.scope]} ${label.toLowerCase()}: ${count(row.limit_value)}`;
}

// Requests the gateways refused (HTTP 429) by day, key and the limit that refused them.
export async function refusalsView(range: DayRange): Promise<HTMLElement> {
  const rows = (await get<{ data: RefusalRow[] }>(`/rate-limit-refusals?start=${range.start}&end=${range.end}`)).data;
  if (rows.length === 0) {
    return h("p", { class: "empty", "data-empty": "refusals" }, h("strong", {}, `No request refused by a rate limit in ${rangeText(range)}. `),
      "A request over a limit is refused with HTTP 429 (RESOURCE_EXHAUSTED); each shows here by day, key and limit.");
  }
  return table(
    ["Day", "API key", "Limit (per minute)", "Refused requests", "Last refused"],
    rows.map((row) => [row.day, row.api_key_name, limitText(row), count(row.refusals), when(row.last_refused_at)]),
    { "data-table": "refusals" },
  );
}
