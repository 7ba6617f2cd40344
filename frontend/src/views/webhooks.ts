import { api, get } from "../api";
import { errorText, h, table, twoStepButton, when } from "../format";
import type { CursorList, WebhookDelivery, WebhookEndpoint } from "../types";

const WEBHOOK_ROLES = ["owner", "admin"];
const EVENT_TYPES = [
  "batch.completed", "batch.failed", "batch.expired", "batch.cancelled",
  "response.completed", "response.failed", "response.cancelled",
];
const DELIVERIES_SHOWN = 10;

const created = (seconds: number) => when(new Date(seconds * 1000).toISOString());

export function canManageWebhooks(role: string | null): boolean {
  return role !== null && WEBHOOK_ROLES.includes(role);
}

// The organization's webhook endpoints: add one (its signing secret is shown once), send a test event, rotate
// the secret, delete; under each, its latest deliveries with their tries.
export async function webhooksView(onChanged: () => void): Promise<HTMLElement> {
  const endpoints = (await get<CursorList<WebhookEndpoint>>("/webhooks?limit=100")).data;
  const secretBox = h("div", { class: "created-key", hidden: true });
  const showSecret = (endpoint: WebhookEndpoint, what: string) => {
    secretBox.replaceChildren(
      h("p", {}, `${what} Copy its signing secret now: it is shown only once.`),
      h("code", { "data-new-secret": "" }, endpoint.signing_secret ?? ""),
      h("button", { type: "button", onclick: () => { secretBox.hidden = true; onChanged(); } }, "Done"),
    );
    secretBox.hidden = false;
  };
  const lists = await Promise.all(endpoints.map((endpoint) => endpointView(endpoint, showSecret, onChanged)));
  const empty = h("p", { class: "muted" }, "No webhook endpoint yet: add one to be told when a batch or a response ends.");
  return h("div", {}, createForm(showSecret), secretBox, ...(lists.length ? lists : [empty]));
}

function createForm(showSecret: (endpoint: WebhookEndpoint, what: string) => void): HTMLElement {
  const url = h("input", { name: "url", type: "url", required: true, placeholder: "https://example.com/webhooks" });
  const name = h("input", { name: "name", maxlength: "100", placeholder: "optional" });
  const boxes = EVENT_TYPES.map((type) => h("input", { type: "checkbox", name: "event_type", value: type, checked: type.startsWith("batch.") }));
  const message = h("p", { class: "error", role: "alert" });
  const form = h("form", { class: "inline", "aria-label": "Add webhook endpoint" },
    h("label", {}, "URL", url),
    h("label", {}, "Endpoint name", name),
    h("fieldset", {}, h("legend", {}, "Events"), ...boxes.map((box) => h("label", { class: "check" }, box, box.value))),
    h("button", { type: "submit" }, "Add endpoint"),
    message,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    message.textContent = "";
    try {
      const endpoint = await api<WebhookEndpoint>("POST", "/webhooks", {
        url: url.value, name: name.value, event_types: boxes.filter((box) => box.checked).map((box) => box.value),
      });
      showSecret(endpoint, `Endpoint ${endpoint.url} added.`);
      url.value = "";
      name.value = "";
    } catch (error) {
      message.textContent = errorText(error);
    }
  });
  return form;
}

async function endpointView(
  endpoint: WebhookEndpoint,
  showSecret: (endpoint: WebhookEndpoint, what: string) => void,
  onChanged: () => void,
): Promise<HTMLElement> {
  const path = `/webhooks/${encodeURIComponent(endpoint.id)}`;
  const deliveries = (await get<CursorList<WebhookDelivery>>(`${path}/deliveries?limit=${DELIVERIES_SHOWN}`)).data;
  const message = h("p", { class: "error", role: "alert" });
  const act = (label: string, action: () => Promise<void>) => {
    const button = h("button", { type: "button", class: "secondary" }, label);
    button.addEventListener("click", async () => {
      message.textContent = "";
      button.disabled = true;
      try { await action(); } catch (error) { message.textContent = errorText(error); button.disabled = false; }
    });
    return button;
  };
  // Sent now, once: its try (answered or not) heads the deliveries once the section reloads.
  const sendTest = act("Send test event", async () => {
    await api("POST", `${path}/test`, {});
    onChanged();
  });
  const rotate = act("Rotate secret", async () => {
    showSecret(await api<WebhookEndpoint>("POST", `${path}/rotate-secret`, {}), `The secret of ${endpoint.url} was rotated; the old one signs beside it for 24 hours.`);
  });
  const remove = twoStepButton("Delete", { "data-delete": endpoint.id }, () => api("DELETE", path), onChanged);
  return h("div", { class: "card", "data-webhook": endpoint.id },
    h("h3", {}, endpoint.name || endpoint.url),
    h("p", { class: "muted" }, h("code", {}, endpoint.url), ` · ${endpoint.event_types.join(", ")} · secret ${endpoint.signing_secret_hint} · added ${created(endpoint.created_at)}`),
    h("div", { class: "actions" }, sendTest, rotate, remove),
    message,
    deliveries.length ? deliveriesTable(deliveries) : h("p", { class: "muted" }, "No delivery yet."),
  );
}

function deliveriesTable(deliveries: WebhookDelivery[]): HTMLElement {
  const rows = deliveries.map((delivery) => {
    const last = delivery.attempts[delivery.attempts.length - 1];
    const answer = !last ? "—" : last.status_code !== null && !last.error ? `HTTP ${last.status_code}` : last.error;
    return [
      delivery.event_type,
      h("code", {}, delivery.event_id),
      h("span", { class: `badge ${delivery.status}`, "data-status": delivery.status }, delivery.status),
      String(delivery.attempts.length),
      answer,
      last ? `${when(last.started_at)} (${last.duration_ms} ms)` : "—",
      delivery.status === "pending" ? when(delivery.next_attempt_at) : "—",
    ];
  });
  return table(["Event", "Event id", "Status", "Tries", "Last answer", "Last try", "Next try"], rows, { "data-table": "webhook-deliveries" });
}
