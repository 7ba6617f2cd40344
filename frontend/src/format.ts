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

export function when(iso: string | null): string {
  if (!iso) return "never";
  return new Date(iso).toLocaleString("en-GB", { dateStyle: "medium", timeStyle: "short", timeZone: "UTC" }) + " UTC";
}

export function isoDay(date: Date): string {
  return date.toISOString().slice(0, 10);
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

export function table(headers: string[], rows: Child[][], attributes: Record<string, string> = {}): HTMLTableElement {
  return h(
    "table",
    attributes,
    h("thead", {}, h("tr", {}, ...headers.map((header) => h("th", {}, header)))),
    h("tbody", {}, ...rows.map((cells) => h("tr", {}, ...cells.map((cell) => h("td", {}, cell))))),
  );
}

export function errorText(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
