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

const daily = <Row>(path: string, range: DayRange, query: string) => {
  const project = shownProject ? `&project_id=${encodeURIComponent(shownProject)}` : "";
  return get<{ data: Row[] }>(`${path}?start=${range.start}&end=${range.end}&${query}${project}`).then((body) => body.data);
};

// The usage of people's keys by key, and that of every batch's runner key as one key named "batch".
async function usageByKey(range: DayRange): Promise<[DailyUsageRow[], DailyRequestsRow[]]> {
  const [tokens, batchTokens, requests, batchRequests] = await Promise.all([
    daily<DailyUsageRow>("/usage/daily", range, "group_by=api_key&api_key_kind=standard"),
    daily<DailyUsageRow>("/usage/daily", range, "group_by=tier&api_key_kind=batch_runner"),
    daily<DailyRequestsRow>("/usage/requests", range, "group_by=api_key&api_key_kind=standard"),
    daily<DailyRequestsRow>("/usage/requests", range, "group_by=tier&api_key_kind=batch_runner"),
  ]);
  const asBatches = <Row extends { key: string }>(rows: Row[]) => rows.map((row) => ({ ...row, key: BATCHES }));
  return [[...tokens, ...asBatches(batchTokens)], [...requests, ...asBatches(batchRequests)]];
}

const sumBy = <Row extends { key: string }>(rows: Row[], key: string, value: (row: Row) => number) =>
  rows.filter((row) => row.key === key).reduce((sum, row) => sum + value(row), 0);

// Requests, tokens and spend of each key (or project, or model) over the range, the biggest spender first.
function keyTotals(
  byKey: DailyUsageRow[],
  requests: DailyRequestsRow[],
  label: (key: string) => string,
  column = "API key",
  name = "key-totals",
): HTMLElement {
  const keys = [...new Set([...byKey, ...requests].map((row) => row.key))];
  const totals = keys.map((key) => ({
    key,
    requests: sumBy(requests, key, (row) => row.requests),
    tokens: sumBy(byKey, key, (row) => row.tokens),
    spend: sumBy(byKey, key, (row) => row.amount_micros),
  })).sort((a, b) => b.spend - a.spend || b.tokens - a.tokens);
  const all = (field: "requests" | "tokens" | "spend") => totals.reduce((sum, row) => sum + row[field], 0);
  return table(
    [column, "Requests", "Tokens", "Spend"],
    [
      ...totals.map((row) => [label(row.key), count(row.requests), count(row.tokens), usd(row.spend)]),
      [h("strong", {}, "Total"), count(all("requests")), count(all("tokens")), usd(all("spend"))],
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
    daily<DailyUsageRow>("/usage/daily", range, "group_by=phase"),
    daily<DailyUsageRow>("/usage/daily", range, "group_by=model"),
    daily<DailyUsageRow>("/usage/daily", range, "group_by=project"),
    daily<DailyRequestsRow>("/usage/requests", range, "group_by=model"),
    daily<DailyRequestsRow>("/usage/requests", range, "group_by=project"),
    usageByKey(range),
  ]);
  if (byPhase.length === 0) {
    const where = shownProject ? "this project's" : "this organization's";
    return h("p", { class: "empty", "data-empty": "usage" }, h("strong", {}, `No usage in ${rangeText(range)}. `),
      `Requests made with ${where} API keys show here by day, phase, model, project and key.`);
  }
  const keyNames = new Map<string, string>([...keys.map((key) => [key.id, `${key.name} (${key.prefix})`] as const), [BATCHES, BATCH_LABEL]]);
  const keyLabel = (key: string) => keyNames.get(key) ?? key;
  const projectNames = new Map(projects.map((project) => [project.id, project.name]));
  const projectLabel = (id: string) => projectNames.get(id) ?? id;
  const phaseTotal = (phase: string) => sumBy(byPhase, phase, (row) => row.tokens);
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
      usageChart("phase", "Tokens by phase", pivot(byPhase, days, (key) => PHASES[key] ?? key, Object.keys(PHASES))),
      usageChart("model", "Tokens by model", pivot(byModel, days, (key) => key)),
      usageChart("project", "Tokens by project", pivot(byProject, days, projectLabel)),
      usageChart("api_key", "Tokens by API key", pivot(byKey, days, keyLabel)),
    ),
    h("h3", {}, `By API key, ${rangeText(range)}`),
    keyTotals(byKey, requests, keyLabel),
    h("h3", {}, `By project, ${rangeText(range)}`),
    keyTotals(byProject, projectRequests, projectLabel, "Project", "project-totals"),
    h("h3", {}, `By model, ${rangeText(range)}`),
    keyTotals(byModel, modelRequests, (key) => key, "Model", "model-totals"),
  );
}
