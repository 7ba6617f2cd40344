import { h, isoDay } from "../format";

// A range of days (UTC), both ends included, as the API takes it: YYYY-MM-DD.
export interface DayRange {
  start: string;
  end: string;
}

const DAY_MS = 86_400_000;
const MAX_DAYS = 366; // what the usage API serves at once
const PRESETS = [7, 14, 30, 90, 365];

export function lastDays(days: number): DayRange {
  const today = Date.parse(`${isoDay(new Date())}T00:00:00Z`);
  return { start: isoDay(new Date(today - (days - 1) * DAY_MS)), end: isoDay(new Date(today)) };
}

// Every day of the range, in order.
export function daysOf(range: DayRange): string[] {
  const days: string[] = [];
  for (let day = Date.parse(`${range.start}T00:00:00Z`); day <= Date.parse(`${range.end}T00:00:00Z`); day += DAY_MS) {
    days.push(isoDay(new Date(day)));
  }
  return days;
}

// "the last 14 days" for a range that ends today, else its first and last day.
export function rangeText(range: DayRange): string {
  const days = daysOf(range).length;
  if (range.end === lastDays(1).end) return days === 1 ? "today" : `the last ${days} days`;
  return range.start === range.end ? range.start : `${range.start} – ${range.end}`;
}

// Presets (the last 7 … 365 days) and any range by its first and last day; `onChange` gets a valid range only.
export function rangePicker(range: DayRange, onChange: (range: DayRange) => void): HTMLElement {
  const isPreset = (value: number) => daysOf(range).length === value && range.end === lastDays(value).end;
  const preset = h("select", { name: "range", "aria-label": "Days shown" },
    ...PRESETS.map((value) => h("option", { value: String(value), selected: isPreset(value) }, `Last ${value} days`)),
    h("option", { value: "", selected: !PRESETS.some(isPreset) }, "Chosen days"));
  const start = h("input", { type: "date", name: "start", value: range.start, "aria-label": "From" });
  const end = h("input", { type: "date", name: "end", value: range.end, "aria-label": "To" });
  const message = h("span", { class: "error", role: "alert" });
  preset.addEventListener("change", () => { if (preset.value) onChange(lastDays(Number(preset.value))); });
  const chosen = () => {
    const picked = { start: start.value, end: end.value };
    const span = picked.start && picked.end ? daysOf(picked).length : 0;
    if (span < 1 || span > MAX_DAYS) message.textContent = `Choose a first day before the last, at most ${MAX_DAYS} days apart.`;
    else onChange(picked);
  };
  start.addEventListener("change", chosen);
  end.addEventListener("change", chosen);
  return h("div", { class: "range", "data-range": "" }, preset, start, end, message);
}
