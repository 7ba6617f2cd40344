import { api, get } from "../api";
import { count, errorText, h, table, usd } from "../format";
import type { ApiKey, OrganizationLimits, RateLimits } from "../types";

export const FIELDS: [keyof RateLimits, string][] = [
  ["requests_per_minute", "Requests / min"],
  ["input_tokens_per_minute", "Input tokens / min"],
  ["output_tokens_per_minute", "Output tokens / min"],
];
const ADMIN_ROLES = ["owner", "admin"];

const shown = (value: number | null) => (value === null ? "unlimited" : count(value));

// Rate limits of the organization and of each key; organization admins get a form to change them.
export async function limitsView(role: string | null, keys: ApiKey[], onChanged: () => void): Promise<HTMLElement> {
  const organization = await get<OrganizationLimits>("/limits");
  const live = keys.filter((key) => !key.revoked_at);
  const rows = [
    [h("strong", {}, "Organization"), ...FIELDS.map(([field]) => shown(organization[field]))],
    ...live.map((key) => [`${key.name} (${key.prefix}…)`, ...FIELDS.map(([field]) => shown(key.limits[field]))]),
  ];
  const list = table(["Applies to", ...FIELDS.map(([, label]) => label)], rows, { "data-table": "limits" });
  const spend = h("p", { class: "muted" },
    `Spend limit: ${organization.spend_limit_micros === null ? "none" : usd(organization.spend_limit_micros)} per period (set it under Billing). `,
    "A request must fit both the organization's limits and its key's.");
  if (!role || !ADMIN_ROLES.includes(role)) return h("div", {}, list, spend);
  return h("div", {}, list, spend, limitsForm(organization, live, onChanged));
}

function limitsForm(organization: OrganizationLimits, keys: ApiKey[], onChanged: () => void): HTMLElement {
  const target = h("select", { name: "target" },
    h("option", { value: "" }, "Organization"),
    ...keys.map((key) => h("option", { value: key.id }, `Key ${key.name} (${key.prefix}…)`)));
  const inputs = FIELDS.map(([field, label]) =>
    [field, h("input", { type: "number", min: "0", step: "1", name: field, placeholder: "unlimited", "aria-label": label })] as const);
  const current = (): RateLimits => (target.value ? keys.find((key) => key.id === target.value)!.limits : organization);
  const fill = () => { for (const [field, input] of inputs) input.value = current()[field] === null ? "" : String(current()[field]); };
  target.addEventListener("change", fill);
  fill();
  const message = h("p", { class: "error", role: "alert" });
  // novalidate: the control plane checks every value and its message names the field and the bound.
  const form = h("form", { class: "inline", "aria-label": "Rate limits", novalidate: true },
    h("label", {}, "Limits of", target),
    ...inputs.map(([field, input]) => h("label", {}, FIELDS.find(([name]) => name === field)![1], input)),
    h("button", { type: "submit" }, "Set limits"),
    message,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    message.textContent = "";
    const unreadable = inputs.find(([, input]) => input.validity.badInput);
    if (unreadable) {
      message.textContent = `${unreadable[0]}: must be a whole number, or blank for unlimited.`;
      return;
    }
    // Blank is unlimited; anything else goes as typed, so that the control plane names what is wrong with it.
    const body = Object.fromEntries(inputs.map(([field, input]) => [field, input.value.trim() === "" ? null : Number(input.value)]));
    const path = target.value ? `/api-keys/${encodeURIComponent(target.value)}/limits` : "/limits";
    try {
      await api("PATCH", path, body);
      onChanged();
    } catch (error) {
      message.textContent = errorText(error);
    }
  });
  return form;
}
