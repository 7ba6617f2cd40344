import { get } from "../api";
import { pivot, usageChart } from "../charts";
import { count, h, table, usd } from "../format";
import type { ApiKey, DailyRequestsRow, DailyUsageRow } from "../types";
import { PHASES } from "./costs";
import { type DayRange, daysOf, rangeText } from "./range";

// Batches' runner keys (one per batch) are left out of the lists and show as one "Batch API" line.
const BATCHES = "batch";
const BATCH_LABEL = "Batch API (all batches)";

interface Project {
  id: string;
  name: string;
  status: "active" | "archived";
}

// The project the usage section shows ("": every project); kept while the dashboard refreshes.
let shownProject = "";

// GET /usage/daily: rows per day and key, and the range's spend rounded once as an invoice rounds (each line),
// with each key's share of it: the dashboard shows these and never adds up rounded amounts of its own.
interface DailyUsage {
  data: DailyUsageRow[];
  totals: { key: string; tokens: number; amount_micros: number }[];
  total_micros: number;
}

const query = (path: string, range: DayRange, filters: string) => {
  const project = shownProject ? `&project_id=${encodeURIComponent(shownProject)}` : "";
  return `${path}?start=${range.start}&end=${range.end}&${filters}${project}`;
};
const usage = (range: DayRange, filters: string) => get<DailyUsage>(query("/usage/daily", range, filters));
const requestsBy = (range: DayRange, filters: string) =>
  get<{ data: DailyRequestsRow[] }>(query("/usage/requests", range, filters)).then((body) => body.data);

// The usage of every key by key, each batch's runner key (one per batch) counted as one key named "batch".
async function usageByKey(range: DayRange): Promise<[DailyUsage, DailyRequestsRow[]]> {
  const [all, runners, requests, batchRequests] = await Promise.all([
    usage(range, "group_by=api_key"),
    usage(range, "group_by=api_key&api_key_kind=batch_runner"),
    requestsBy(range, "group_by=api_key&api_key_kind=standard"),
    requestsBy(range, "group_by=tier&api_key_kind=batch_runner"),
  ]);
  const runnerKeys = new Set(runners.totals.map((row) => row.key));
  const named = <Row extends { key: string }>(row: Row) => (runnerKeys.has(row.key) ? { ...row, key: BATCHES } : row);
  const byKey = { data: all.data.map(named), totals: all.totals.map(named), total_micros: all.total_micros };
  return [byKey, [...requests, ...batchRequests.map((row) => ({ ...row, key: BATCHES }))]];
}

const sumBy = <Row extends { key: string }>(rows: Row[], key: string, value: (row: Row) => number) =>
  rows.filter((row) => row.key === key).reduce((sum, row) => sum + value(row), 0);

// Requests, tokens and spend of each key (or project, or model) over the range, the biggest spender first. The
// spends are the API's shares of its total (whole micro-dollars that add up to it), so they are only ever added.
function keyTotals(
  usage: DailyUsage,
  requests: DailyRequestsRow[],
  label: (key: string) => string,
  column = "API key",
  name = "key-totals",
): HTMLElement {
  const keys = [...new Set([...usage.totals, ...requests].map((row) => row.key))];
  const totals = keys.map((key) => ({
    key,
    requests: sumBy(requests, key, (row) => row.requests),
    tokens: sumBy(usage.totals, key, (row) => row.tokens),
    spend: sumBy(usage.totals, key, (row) => row.amount_micros),
  })).sort((a, b) => b.spend - a.spend || b.tokens - a.tokens);
  const all = (field: "requests" | "tokens") => totals.reduce((sum, row) => sum + row[field], 0);
  return table(
    [column, "Requests", "Tokens", "Spend"],
    [
      ...totals.map((row) => [label(row.key), count(row.requests), count(row.tokens), usd(row.spend)]),
      [h("strong", {}, "Total"), count(all("requests")), count(all("tokens")), usd(usage.total_micros)],
    ],
    { "data-table": name },
  );
}

// Every project, or one: the usage below is then that project's only.
function projectPicker(projects: Project[], onChange: () => void): HTMLElement {
  const select = h("select", { name: "project", "aria-label": "Project", "data-project-filter": "" },
    h("option", { value: "", selected: shownProject === "" }, "All projects"),
    ...projects.map((project) => h("option", { value: project.id, selected: project.id === shownProject },
      project.status === "archived" ? `${project.name} (archived)` : project.name)));
  select.addEventListener("change", () => { shownProject = select.value; onChange(); });
  return h("div", { class: "range" }, select);
}

// Charts of tokens per day by phase, model, project and API key; requests, tokens and spend by key, by project
// and by model; for every project or for the one picked.
export async function usageView(range: DayRange, keys: ApiKey[]): Promise<HTMLElement> {
  const projects = await get<{ data: Project[] }>("/projects?include_archived=true&limit=1000").then((body) => body.data);
  if (!projects.some((project) => project.id === shownProject)) shownProject = "";
  const view = h("div", {});
  const render = async () => view.replaceChildren(projectPicker(projects, render), await usageOf(range, keys, projects));
  await render();
  return view;
}

async function usageOf(range: DayRange, keys: ApiKey[], projects: Project[]): Promise<HTMLElement> {
  const days = daysOf(range);
  const [byPhase, byModel, byProject, modelRequests, projectRequests, [byKey, requests]] = await Promise.all([
    usage(range, "group_by=phase"),
    usage(range, "group_by=model"),
    usage(range, "group_by=project"),
    requestsBy(range, "group_by=model"),
    requestsBy(range, "group_by=project"),
    usageByKey(range),
  ]);
  if (byPhase.data.length === 0) {
    const where = shownProject ? "this project's" : "this organization's";
    return h("p", { class: "empty", "data-empty": "usage" }, h("strong", {}, `No usage in ${rangeText(range)}. `),
      `Requests made with ${where} API keys show here by day, phase, model, project and key.`);
  }
  const keyNames = new Map<string, string>([...keys.map((key) => [key.id, `${key.name} (${key.prefix})`] as const), [BATCHES, BATCH_LABEL]]);
  const keyLabel = (key: string) => keyNames.get(key) ?? key;
  const projectNames = new Map(projects.map((project) => [project.id, project.name]));
  const projectLabel = (id: string) => projectNames.get(id) ?? id;
  const phaseTotal = (phase: string) => sumBy(byPhase.data, phase, (row) => row.tokens);
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
      usageChart("phase", "Tokens by phase", pivot(byPhase.data, days, (key) => PHASES[key] ?? key, Object.keys(PHASES))),
      usageChart("model", "Tokens by model", pivot(byModel.data, days, (key) => key)),
      usageChart("project", "Tokens by project", pivot(byProject.data, days, projectLabel)),
      usageChart("api_key", "Tokens by API key", pivot(byKey.data, days, keyLabel)),
    ),
    h("h3", {}, `By API key, ${rangeText(range)}`),
    keyTotals(byKey, requests, keyLabel),
    h("h3", {}, `By project, ${rangeText(range)}`),
    keyTotals(byProject, projectRequests, projectLabel, "Project", "project-totals"),
    h("h3", {}, `By model, ${rangeText(range)}`),
    keyTotals(byModel, modelRequests, (key) => key, "Model", "model-totals"),
  );
}
