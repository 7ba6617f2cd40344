// Daily usage and cost charts (Chart.js), each mirrored by a data table for screen readers and tests.

import { BarController, BarElement, CategoryScale, Chart, Legend, LinearScale, Title, Tooltip } from "chart.js";
import { count, h, table, usd } from "./format";

Chart.register(BarController, BarElement, CategoryScale, LinearScale, Legend, Title, Tooltip);

const PALETTE = ["#2f6fdf", "#27a376", "#e8833a", "#9b59b6", "#d64545", "#14a3b8", "#7f8c8d", "#c9a227"];

// The page's chart instances by name, for whoever needs the exact plotted data (tests among them).
declare global {
  interface Window {
    diptychCharts: Record<string, Chart>;
  }
}
window.diptychCharts = {};

export interface DailySeries {
  days: string[];
  series: { key: string; label: string; values: number[] }[];
}

// What a chart plots: token counts, or money in micro-dollars (plotted in dollars).
export interface Measure {
  axis: string;
  text: (value: number) => string;
  plotted: (value: number) => number;
}
export const TOKENS: Measure = { axis: "tokens", text: count, plotted: (value) => value };
export const COST: Measure = { axis: "USD", text: usd, plotted: (micros) => micros / 1_000_000 };

interface DailyRow {
  day: string;
  key: string;
}

// Pivots API rows into one series per key over every day of the range (missing days are 0).
export function pivot<Row extends DailyRow>(
  rows: Row[],
  days: string[],
  label: (key: string) => string,
  order: string[] = [],
  value: (row: Row) => number = (row) => (row as Row & { tokens: number }).tokens,
): DailySeries {
  const keys = [...new Set([...order, ...rows.map((row) => row.key)])];
  const index = new Map(days.map((day, position) => [day, position]));
  const series = keys.map((key) => ({ key, label: label(key), values: days.map(() => 0) }));
  const byKey = new Map(series.map((entry) => [entry.key, entry]));
  for (const row of rows) {
    const position = index.get(row.day);
    if (position !== undefined) byKey.get(row.key)!.values[position] += value(row);
  }
  return { days, series };
}

export function usageChart(name: string, title: string, data: DailySeries, measure: Measure = TOKENS): HTMLElement {
  window.diptychCharts[name]?.destroy();
  const canvas = h("canvas", { "aria-label": title, role: "img" });
  const totals = data.series.map((entry) => entry.values.reduce((sum, value) => sum + value, 0));
  const figure = h(
    "figure",
    { class: "chart", "data-chart": name },
    h("div", { class: "chart-canvas" }, canvas),
    h(
      "details",
      {},
      h("summary", {}, "Data"),
      table(
        ["Day", ...data.series.map((entry) => entry.label)],
        [
          ...data.days.map((day, position) => [day, ...data.series.map((entry) => measure.text(entry.values[position]))]),
          ["Total", ...totals.map(measure.text)],
        ],
        { "data-chart-table": name },
      ),
    ),
  );
  window.diptychCharts[name] = new Chart(canvas, {
    type: "bar",
    data: {
      labels: data.days,
      datasets: data.series.map((entry, position) => ({
        label: entry.label,
        data: entry.values.map(measure.plotted),
        backgroundColor: PALETTE[position % PALETTE.length],
      })),
    },
    options: {
      responsive: true,
      maintainAspectRatio: false,
      animation: false,
      plugins: { title: { display: true, text: title }, legend: { position: "bottom" } },
      scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true, title: { display: true, text: measure.axis } } },
    },
  });
  return figure;
}
