// Requests: the log of recent requests, the phases of the one selected on a time line, and latency percentiles per day.

import { Chart } from "chart.js";
import { get } from "../api";
import { pivot } from "../charts";
import { count, errorText, h, table, usd, when } from "../format";
import type { ApiKey } from "../types";
import { type DayRange, daysOf } from "./range";

// GET /usage/requests/{id} and the rows of GET /usage/request-log (docs/control-plane.md, "Requests and their phases").
interface RequestPhase {
  type: "prefill" | "kv_handoff" | "decode" | "colocated";
  worker_id: string | null;
  offset_ms: number;
  duration_ms: number;
  compute_ms: number | null;
  queued_ms: number | null;
  computed_tokens: number | null;
  cached_tokens: number | null;
  output_tokens: number | null;
  kv_bytes: number | null;
}

interface RequestRow {
  id: string;
  client_request_id: string;
  model: string;
  route: "split" | "colocated" | "prefill_only" | "decode_only";
  api_key_id: string;
  started_at: string;
  duration_ms: number;
  time_to_first_token_ms: number | null;
  phases: RequestPhase[];
  totals: { prompt_tokens: number; cached_tokens: number; output_tokens: number; kv_bytes: number };
}

interface RequestDetail extends RequestRow {
  cost: { amount_micros: number; lines: { phase: string; tokens: number; unit_price_micros_per_million: number | null }[] };
}

interface RequestLog {
  data: RequestRow[];
  last_id: string | null;
  has_more: boolean;
}

interface Percentiles {
  p50: number;
  p90: number;
  p99: number;
}

interface LatencyRow {
  day: string;
  model: string;
  requests: number;
  time_to_first_token_ms: Percentiles;
  duration_ms: Percentiles;
}

const PAGE = 20;
const BAR_COLORS: Record<string, string> = { Queued: "#c5ccd8", Prefill: "#2f6fdf", "KV hand-off": "#e8833a", Decode: "#27a376", Colocated: "#9b59b6" };
const PERCENTILE_COLORS = ["#2f6fdf", "#e8833a", "#d64545"];

const ms = (value: number | null): string => (value === null ? "—" : `${value.toLocaleString("en-US", { maximumFractionDigits: 1 })} ms`);

function bytes(value: number): string {
  if (value < 1024) return `${value} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let scaled = value / 1024;
  let unit = 0;
  while (scaled >= 1024 && unit < units.length - 1) { scaled /= 1024; unit += 1; }
  return `${scaled.toLocaleString("en-US", { maximumFractionDigits: 1 })} ${units[unit]}`;
}

// The bars of the time line, in time order: a prefill (or colocated) phase shows its queueing first, then its compute.
function timelineBars(phases: RequestPhase[]): { label: string; start: number; end: number }[] {
  const bars: { label: string; start: number; end: number }[] = [];
  for (const phase of phases) {
    const end = phase.offset_ms + phase.duration_ms;
    if (phase.type === "prefill" || phase.type === "colocated") {
      const queued = Math.min(phase.queued_ms ?? 0, phase.duration_ms);
      bars.push({ label: "Queued", start: phase.offset_ms, end: phase.offset_ms + queued });
      bars.push({ label: phase.type === "prefill" ? "Prefill" : "Colocated", start: phase.offset_ms + queued, end });
    } else {
      bars.push({ label: phase.type === "kv_handoff" ? "KV hand-off" : "Decode", start: phase.offset_ms, end });
    }
  }
  return bars;
}

function timelineChart(request: RequestDetail): HTMLElement {
  window.diptychCharts.timeline?.destroy();
  const bars = timelineBars(request.phases);
  const title = `Phases of ${request.id}`;
  const canvas = h("canvas", { "aria-label": title, role: "img" });
  const figure = h("figure", { class: "chart timeline", "data-chart": "timeline" }, h("div", { class: "chart-canvas timeline-canvas" }, canvas));
  window.diptychCharts.timeline = new Chart(canvas, {
    type: "bar",
    data: {
      labels: bars.map((bar) => bar.label),
      datasets: [{
        label: "ms from the request's start",
        data: bars.map((bar) => [bar.start, bar.end]),
        backgroundColor: bars.map((bar) => BAR_COLORS[bar.label]),
        minBarLength: 2,
      }],
    },
    options: {
      indexAxis: "y",
      responsive: true,
      maintainAspectRatio: false,
      animation: false,
      plugins: {
        title: { display: true, text: title },
        legend: { display: false },
        tooltip: { callbacks: { label: (item) => { const bar = bars[item.dataIndex]; return `${ms(bar.start)} → ${ms(bar.end)} (${ms(bar.end - bar.start)})`; } } },
      },
      scales: {
        x: { beginAtZero: true, title: { display: true, text: "ms" }, ticks: { callback: (value) => `${value} ms` } },
      },
    },
  });
  return figure;
}

function phaseName(phase: RequestPhase): string {
  return { prefill: "Prefill", kv_handoff: "KV hand-off", decode: "Decode", colocated: "Colocated (one worker)" }[phase.type];
}

function phaseTokens(phase: RequestPhase): string {
  if (phase.type === "kv_handoff") return bytes(phase.kv_bytes ?? 0);
  const parts = [];
  if (phase.computed_tokens !== null) parts.push(`${count(phase.computed_tokens)} computed, ${count(phase.cached_tokens ?? 0)} cached`);
  if (phase.output_tokens !== null) parts.push(`${count(phase.output_tokens)} out`);
  return parts.join("; ");
}

function requestDetail(request: RequestDetail): HTMLElement {
  const phases = table(
    ["Phase", "Worker", "Starts at", "Time", "Compute", "Queued", "Tokens / bytes"],
    request.phases.map((phase) => [
      phaseName(phase), phase.worker_id ?? "—", ms(phase.offset_ms), ms(phase.duration_ms), ms(phase.compute_ms), ms(phase.queued_ms), phaseTokens(phase),
    ]),
    { "data-table": "phases" },
  );
  const stat = (label: string, value: string, name: string) => h("div", { class: "card stat" }, h("span", {}, label), h("strong", { "data-stat": name }, value));
  return h("div", { class: "request-detail", "data-request": request.id },
    h("h3", {}, `Request ${request.id}`),
    h("div", { class: "cards" },
      stat("Time to first token", ms(request.time_to_first_token_ms), "ttft"),
      stat("Duration", ms(request.duration_ms), "duration"),
      stat("Tokens in / out", `${count(request.totals.prompt_tokens)} / ${count(request.totals.output_tokens)}`, "tokens"),
      stat("Cost", usd(request.cost.amount_micros), "cost"),
    ),
    timelineChart(request),
    phases,
  );
}

function percentilesChart(name: string, title: string, rows: LatencyRow[], days: string[], measure: (row: LatencyRow) => Percentiles): HTMLElement {
  window.diptychCharts[name]?.destroy();
  const names = ["p50", "p90", "p99"] as const;
  const flat = rows.flatMap((row) => names.map((key) => ({ day: row.day, key, value: measure(row)[key] })));
  const data = pivot(flat, days, (key) => key, [...names], (row) => row.value);
  const canvas = h("canvas", { "aria-label": title, role: "img" });
  const figure = h("figure", { class: "chart", "data-chart": name },
    h("div", { class: "chart-canvas" }, canvas),
    h("details", {}, h("summary", {}, "Data"),
      table(["Day", ...names], data.days.map((day, position) => [day, ...data.series.map((entry) => ms(entry.values[position]))]), { "data-chart-table": name })));
  window.diptychCharts[name] = new Chart(canvas, {
    type: "bar",
    data: { labels: data.days, datasets: data.series.map((entry, position) => ({ label: entry.label, data: entry.values, backgroundColor: PERCENTILE_COLORS[position] })) },
    options: {
      responsive: true,
      maintainAspectRatio: false,
      animation: false,
      plugins: { title: { display: true, text: title }, legend: { position: "bottom" } },
      scales: { y: { beginAtZero: true, title: { display: true, text: "ms" }, ticks: { callback: (value) => `${value} ms` } } },
    },
  });
  return figure;
}

function routeText(route: RequestRow["route"]): string {
  return { split: "Split", colocated: "Colocated", prefill_only: "Prefill only", decode_only: "Decode only (a choice)" }[route];
}

function filtersQuery(range: DayRange, key: string, model: string): string {
  const query = new URLSearchParams({ start: range.start, end: range.end });
  if (key) query.set("api_key_id", key);
  if (model) query.set("model", model);
  return query.toString();
}

// The section's body: filters, the latency charts of the range, the log (pages of PAGE), and the selected request.
export async function requestsView(range: DayRange, keys: ApiKey[]): Promise<HTMLElement> {
  const keyFilter = h("select", { name: "request-key", "aria-label": "Requests of key" },
    h("option", { value: "" }, "Every key"), ...keys.map((key) => h("option", { value: key.id }, key.name)));
  const modelFilter = h("select", { name: "request-model", "aria-label": "Requests of model" }, h("option", { value: "" }, "Every model"));
  const latency = h("div", { class: "charts" });
  const log = h("div", { class: "request-log" });
  const detail = h("div", { "aria-live": "polite" });
  const body = h("div", { class: "requests" },
    h("div", { class: "range" }, keyFilter, modelFilter),
    latency,
    h("h3", {}, "Recent requests"),
    log,
    detail,
  );
  const keyName = new Map(keys.map((key) => [key.id, key.name]));

  const select = async (id: string) => {
    detail.replaceChildren(h("p", { class: "muted" }, "Loading…"));
    try {
      detail.replaceChildren(requestDetail(await get<RequestDetail>(`/usage/requests/${encodeURIComponent(id)}`)));
    } catch (error) {
      detail.replaceChildren(h("p", { class: "error", role: "alert" }, errorText(error)));
    }
  };

  const rowCells = (row: RequestRow) => [
    when(row.started_at),
    h("button", { type: "button", class: "link request-id", "data-request-id": row.id, onclick: () => select(row.id) }, row.id),
    row.model,
    keyName.get(row.api_key_id) ?? row.api_key_id,
    routeText(row.route),
    ms(row.time_to_first_token_ms),
    ms(row.duration_ms),
    `${count(row.totals.prompt_tokens)} / ${count(row.totals.output_tokens)}`,
  ];
  const headers = ["Started", "Request id", "Model", "API key", "Route", "Time to first token", "Duration", "Tokens in / out"];

  const loadLog = async (after: string | null, shown: RequestRow[]): Promise<void> => {
    const query = filtersQuery(range, keyFilter.value, modelFilter.value) + `&limit=${PAGE}` + (after ? `&after=${encodeURIComponent(after)}` : "");
    const page = await get<RequestLog>(`/usage/request-log?${query}`);
    const rows = [...shown, ...page.data];
    if (rows.length === 0) {
      log.replaceChildren(h("p", { class: "empty", "data-empty": "requests" }, "No request in these days. Each request the gateway answered shows here with its phases."));
      detail.replaceChildren();
      return;
    }
    const more = page.has_more
      ? h("button", { type: "button", class: "secondary", onclick: () => loadLog(page.last_id, rows) }, "Show more")
      : null;
    log.replaceChildren(table(headers, rows.map(rowCells), { "data-table": "request-log" }), more ?? "");
    if (!after) await select(rows[0].id);
  };

  const loadLatency = async (): Promise<void> => {
    const rows = (await get<{ data: LatencyRow[] }>(`/usage/latency?${filtersQuery(range, keyFilter.value, "")}`)).data;
    const models = [...new Set(rows.map((row) => row.model))].sort();
    if (modelFilter.options.length === 1) modelFilter.append(...models.map((model) => h("option", { value: model }, model)));
    const model = modelFilter.value || models[0];
    const shown = rows.filter((row) => row.model === model);
    if (shown.length === 0) {
      latency.replaceChildren();
      return;
    }
    const days = daysOf(range);
    latency.replaceChildren(
      percentilesChart("latency_ttft", `Time to first token, ${model}`, shown, days, (row) => row.time_to_first_token_ms),
      percentilesChart("latency_duration", `Duration, ${model}`, shown, days, (row) => row.duration_ms),
    );
  };

  const reload = () => Promise.all([loadLatency(), loadLog(null, [])]);
  keyFilter.addEventListener("change", () => { reload(); });
  modelFilter.addEventListener("change", () => { reload(); });
  await reload();
  return body;
}
