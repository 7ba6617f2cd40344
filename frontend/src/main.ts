import "./style.css";
import { api, get } from "./api";
import { errorText, h } from "./format";
import type { ApiKey, ListPage, Me, Session } from "./types";
import { batchesView, canSeeBatches } from "./views/batches";
import { billingView } from "./views/billing";
import { costsView } from "./views/costs";
import { fleetView } from "./views/fleet";
import { invoicesView } from "./views/invoices";
import { keysView } from "./views/keys";
import { limitsView } from "./views/limits";
import { loginView } from "./views/login";
import { type DayRange, lastDays, rangePicker, rangeText } from "./views/range";
import { refusalsView } from "./views/refusals";
import { requestsView } from "./views/requests";
import { usageView } from "./views/usage";
import { canManageWebhooks, webhooksView } from "./views/webhooks";

const app = document.getElementById("app")!;
const FLEET_REFRESH_MS = 3000;
let fleetTimer: number | undefined;
let usageRange: DayRange = lastDays(14);

// The session answers whether the browser is signed in without an error, so that nothing is logged before sign-in.
async function start(): Promise<void> {
  try {
    const session = await get<Session>("/auth/session");
    if (session.user) showDashboard(session.user);
    else showLogin();
  } catch (error) {
    app.replaceChildren(failure(`The control plane did not answer: ${errorText(error)}`, start));
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
    // People's keys: batches' runner keys are listed only when asked for (GET /api-keys?kind=batch_runner).
    const keys = get<ListPage<ApiKey>>("/api-keys?limit=200").then((page) => page.data);
    const range = rangePicker(usageRange, (chosen) => { usageRange = chosen; refresh(); });
    sections.push(
      section("billing", "Billing", () => billingView(refresh)),
      section("costs", "Cost this period", costsView),
      section("usage", "Usage", async () => usageView(usageRange, await keys), range),
      section("requests", "Requests", async () => requestsView(usageRange, await keys)),
      section("api-keys", "API keys", async () => keysView(await keys, refresh)),
      section("limits", "Rate limits", async () => limitsView(me.role, await keys, refresh)),
      section("refusals", `Refused by a rate limit, ${rangeText(usageRange)}`, () => refusalsView(usageRange)),
      section("invoices", "Invoices", invoicesView),
    );
    if (canSeeBatches(me.role)) sections.push(section("batches", "Batches", () => batchesView(refresh)));
    if (canManageWebhooks(me.role)) sections.push(section("webhooks", "Webhooks", () => webhooksView(refresh)));
  }
  if (me.is_staff) {
    const reload = async () => {
      const body = fleet.querySelector(".section-body")!;
      try { body.replaceChildren(await fleetView(reload)); } catch (error) { body.replaceChildren(failure(errorText(error), refresh)); }
    };
    const [fleet, loaded] = section("fleet", "Fleets and workers", () => fleetView(reload));
    sections.push([fleet, loaded]);
    // Live state; not while a "Confirm drain" waits for its second click.
    fleetTimer = window.setInterval(() => { if (!fleet.querySelector("[data-armed=yes]")) reload(); }, FLEET_REFRESH_MS);
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
