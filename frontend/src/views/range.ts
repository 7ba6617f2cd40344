import { h, isoDay, parseDay } from "../format";

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

// Presets (the last 7 … 365 days) and any range by its first and last day, written YYYY-MM-DD as every date on
// the page is (format.ts); `onChange` gets a valid range only, as soon as both days are whole.
export function rangePicker(range: DayRange, onChange: (range: DayRange) => void): HTMLElement {
  const isPreset = (value: number) => daysOf(range).length === value && range.end === lastDays(value).end;
  const preset = h("select", { name: "range", "aria-label": "Days shown" },
    ...PRESETS.map((value) => h("option", { value: String(value), selected: isPreset(value) }, `Last ${value} days`)),
    h("option", { value: "", selected: !PRESETS.some(isPreset) }, "Chosen days"));
  const dayInput = (name: string, value: string, label: string) => h("input", {
    type: "text", name, value, "aria-label": label, inputmode: "numeric", maxlength: "10", size: "10",
    placeholder: "YYYY-MM-DD", autocomplete: "off", spellcheck: "false", "data-day": "",
  });
  const start = dayInput("start", range.start, "From");
  const end = dayInput("end", range.end, "To");
  const message = h("span", { class: "error", role: "alert" });
  preset.addEventListener("change", () => { if (preset.value) onChange(lastDays(Number(preset.value))); });
  const problem = (): string | DayRange => {
    const picked = { start: parseDay(start.value.trim()), end: parseDay(end.value.trim()) };
    if (!picked.start || !picked.end) return "Write each day as YYYY-MM-DD, e.g. 2026-11-18.";
    const span = daysOf({ start: picked.start, end: picked.end }).length;
    if (span < 1 || span > MAX_DAYS) return `Choose a first day before the last, at most ${MAX_DAYS} days apart.`;
    return { start: picked.start, end: picked.end };
  };
  // While a day is being typed nothing happens; once both are whole days the range is taken; leaving a field
  // with a day that is not one says why.
  const typed = () => {
    const chosen = problem();
    if (typeof chosen !== "string") onChange(chosen);
    else if (start.value.length === 10 && end.value.length === 10) message.textContent = chosen;
    else message.textContent = "";
  };
  const left = () => {
    const chosen = problem();
    message.textContent = typeof chosen === "string" ? chosen : "";
  };
  for (const input of [start, end]) {
    input.addEventListener("input", typed);
    input.addEventListener("change", left);
  }
  return h("div", { class: "range", "data-range": "" }, preset, start, end, message);
}
