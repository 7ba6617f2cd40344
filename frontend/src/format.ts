// Formatting of money (micro-dollars, cents), token counts, dates and DOM building.

export function usd(micros: number): string {
  return (micros / 1_000_000).toLocaleString("en-US", { style: "currency", currency: "USD", minimumFractionDigits: 2, maximumFractionDigits: 6 });
}

export function usdCents(cents: number): string {
  return (cents / 100).toLocaleString("en-US", { style: "currency", currency: "USD" });
}

export function count(value: number): string {
  return value.toLocaleString("en-US");
}

// Every date the dashboard shows is written one way, as the API writes days: YYYY-MM-DD (UTC), and a moment as
// "YYYY-MM-DD HH:MM UTC". A browser's <input type=date> shows its own locale's format (not the page's lang), so
// the range picker takes days in this format as text too (views/range.ts).
export function when(iso: string | null): string {
  if (!iso) return "never";
  const utc = new Date(iso).toISOString();
  return `${utc.slice(0, 10)} ${utc.slice(11, 16)} UTC`;
}

export function isoDay(date: Date): string {
  return date.toISOString().slice(0, 10);
}

// The day of a YYYY-MM-DD text, or null when it is not one (a wrong shape, or no such day: 2026-02-30).
export function parseDay(text: string): string | null {
  if (!/^\d{4}-\d{2}-\d{2}$/.test(text)) return null;
  const time = Date.parse(`${text}T00:00:00Z`);
  return Number.isNaN(time) || isoDay(new Date(time)) !== text ? null : text;
}

// Exact micro-dollars as a decimal number of dollars ("0.000123"), for files meant for spreadsheets.
export function dollarsExact(micros: number): string {
  const whole = Math.floor(micros / 1_000_000);
  return `${whole}.${String(micros - whole * 1_000_000).padStart(6, "0")}`;
}

// A period given by its first day and its exclusive end, by its first and last day: "2026-11-01 – 2026-11-30".
export function periodText(start: string, endExclusive: string): string {
  const last = new Date(Date.parse(`${endExclusive.slice(0, 10)}T00:00:00Z`) - 86_400_000);
  return `${start.slice(0, 10)} – ${isoDay(last)}`;
}

type Child = Node | string | number | null | undefined | false;

// Creates an element: h("td", { class: "num" }, "42"). Attributes starting with "on" are listeners.
export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attributes: Record<string, string | boolean | EventListener> = {},
  ...children: Child[]
): HTMLElementTagNameMap[K] {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (typeof value === "function") element.addEventListener(name.slice(2), value);
    else if (value === true) element.setAttribute(name, "");
    else if (value !== false) element.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
  return element;
}

// A table in a box of its own width: its cells wrap, and on a phone's width each row is a card (style.css).
export function table(headers: string[], rows: Child[][], attributes: Record<string, string> = {}): HTMLElement {
  return h(
    "div",
    { class: "table-scroll" },
    h(
      "table",
      attributes,
      h("thead", {}, h("tr", {}, ...headers.map((header) => h("th", {}, header)))),
      // Each cell names its column: on a phone's width a row shows as a card of "column: value" lines.
      h("tbody", {}, ...rows.map((cells) => h("tr", {}, ...cells.map((cell, column) => h("td", { "data-label": headers[column] ?? "" }, cell))))),
    ),
  );
}

// A button that acts on its second click ("Revoke", then "Confirm revoke") rather than through a browser dialog;
// `data-armed="yes"` between the two. A failed action shows its error on the button.
export function twoStepButton(
  label: string,
  attributes: Record<string, string>,
  action: () => Promise<unknown>,
  onDone: () => void,
): HTMLButtonElement {
  const button = h("button", { type: "button", class: "danger", ...attributes }, label);
  button.addEventListener("click", async () => {
    if (button.dataset.armed !== "yes") {
      button.dataset.armed = "yes";
      button.textContent = `Confirm ${label.toLowerCase()}`;
      return;
    }
    button.disabled = true;
    try {
      await action();
      onDone();
    } catch (error) {
      button.textContent = errorText(error);
    }
  });
  return button;
}

export function errorText(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
