import "./style.css";
import { api, ApiError, get } from "./api";
import { errorText, h } from "./format";
import type { ApiKey, ListPage, Me } from "./types";
import { batchesView, canSeeBatches } from "./views/batches";
import { billingView } from "./views/billing";
import { costsView } from "./views/costs";
import { fleetView } from "./views/fleet";
import { invoicesView } from "./views/invoices";
import { keysView } from "./views/keys";
import { limitsView } from "./views/limits";
import { loginView } from "./views/login";
import { usageView } from "./views/usage";

const app = document.getElementById("app")!;
const FLEET_REFRESH_MS = 3000;
let fleetTimer: number | undefined;
let usageDays = 14;

async function start(): Promise<void> {
  try {
    showDashboard(await get<Me>("/auth/me"));
  } catch (error) {
    if (error instanceof ApiError && (error.status === 401 || error.status === 403)) showLogin();
    else app.replaceChildren(failure(`The control plane did not answer: ${errorText(error)}`, start));
  }
}

function showLogin(): void {
  window.clearInterval(fleetTimer);
  app.dataset.state = "signed-out";
  app.replaceChildren(loginView(showDashboard));
}

// An error message with a button that tries again.
function failure(message: string, retry: () => void): HTMLElement {
  return h("div", { class: "failure", role: "alert" },
    h("p", { class: "error" }, message),
    h("button", { type: "button", class: "secondary", onclick: () => retry() }, "Retry"));
}

// A titled section whose body loads on its own; a failure shows in the section, not the page, with a retry.
function section(id: string, title: string, body: () => Promise<HTMLElement>, tools: HTMLElement | null = null): [HTMLElement, Promise<void>] {
  const content = h("div", { class: "section-body" });
  const element = h("section", { id, "aria-labelledby": `${id}-title` }, h("header", {}, h("h2", { id: `${id}-title` }, title), tools), content);
  const load = (): Promise<void> => {
    content.replaceChildren(h("p", { class: "muted" }, "Loading…"));
    return body().then(
      (node) => content.replaceChildren(node),
      (error) => content.replaceChildren(failure(errorText(error), load)),
    );
  };
  return [element, load()];
}

function showDashboard(me: Me): void {
  window.clearInterval(fleetTimer);
  app.dataset.state = "loading";
  const refresh = () => showDashboard(me);
  const signOut = h("button", { type: "button", class: "link" }, "Sign out");
  signOut.addEventListener("click", async () => {
    await api("POST", "/auth/logout").catch(() => undefined);
    showLogin();
  });
  const who = [me.email, me.role, me.is_staff ? "staff" : null].filter(Boolean).join(" · ");
  const sections: [HTMLElement, Promise<void>][] = [];

  if (me.organization) {
    const keys = get<ListPage<ApiKey>>("/api-keys?limit=200").then((page) => page.data);
    const days = h("select", { name: "days", "aria-label": "Days shown" },
      ...[7, 14, 30].map((value) => h("option", { value: String(value), selected: value === usageDays }, `Last ${value} days`)));
    days.addEventListener("change", () => { usageDays = Number(days.value); refresh(); });
    sections.push(
      section("billing", "Billing", () => billingView(refresh)),
      section("costs", "Cost this period", costsView),
      section("usage", "Usage", async () => usageView(usageDays, await keys), days),
      section("api-keys", "API keys", async () => keysView(await keys, refresh)),
      section("limits", "Rate limits", async () => limitsView(me.role, await keys, refresh)),
      section("invoices", "Invoices", invoicesView),
    );
    if (canSeeBatches(me.role)) sections.push(section("batches", "Batches", () => batchesView(refresh)));
  }
  if (me.is_staff) {
    const [fleet, loaded] = section("fleet", "Fleets and workers", fleetView);
    sections.push([fleet, loaded]);
    fleetTimer = window.setInterval(async () => {
      const body = fleet.querySelector(".section-body")!;
      try { body.replaceChildren(await fleetView()); } catch (error) { body.replaceChildren(failure(errorText(error), refresh)); }
    }, FLEET_REFRESH_MS);
  }
  app.replaceChildren(
    h("header", { class: "topbar" },
      h("strong", {}, "Diptych"),
      h("span", { "data-organization": "" }, me.organization?.name ?? "no organization"),
      h("span", { class: "muted" }, who),
      signOut,
    ),
    h("main", {}, ...(sections.length ? sections.map(([element]) => element) : [h("p", {}, "Your account belongs to no organization yet.")])),
  );
  Promise.all(sections.map(([, loaded]) => loaded)).then(() => { app.dataset.state = "ready"; });
}

start();
