import { api } from "../api";
import { errorText, h, table, twoStepButton, when } from "../format";
import type { ApiKey } from "../types";

const SCOPES = ["inference", "admin:read", "admin:write"];

// The organization's API keys: create (the secret is shown once), list, revoke.
export function keysView(keys: ApiKey[], onChanged: () => void): HTMLElement {
  const name = h("input", { name: "name", required: true, maxlength: "100", placeholder: "e.g. production" });
  const scopes = SCOPES.map((scope) => h("input", { type: "checkbox", name: "scope", value: scope, checked: scope === "inference" }));
  const message = h("p", { class: "error", role: "alert" });
  const created = h("div", { class: "created-key", hidden: true });
  const form = h("form", { class: "inline", "aria-label": "Create API key" },
    h("label", {}, "Name", name),
    h("fieldset", {}, h("legend", {}, "Scopes"), ...scopes.map((box) => h("label", { class: "check" }, box, box.value))),
    h("button", { type: "submit" }, "Create key"),
    message,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    message.textContent = "";
    try {
      const key = await api<ApiKey>("POST", "/api-keys", {
        name: name.value, scopes: scopes.filter((box) => box.checked).map((box) => box.value), expires_at: null,
      });
      created.replaceChildren(
        h("p", {}, `Key "${key.name}" created. Copy it now: it is shown only once.`),
        h("code", { "data-new-key": "" }, key.key ?? ""),
        h("button", { type: "button", onclick: () => { created.hidden = true; onChanged(); } }, "Done"),
      );
      created.hidden = false;
      name.value = "";
    } catch (error) {
      message.textContent = errorText(error);
    }
  });

  const rows = keys.map((key) => [
    key.name,
    h("code", { class: "key-prefix" }, key.prefix),
    key.scopes.join(", "),
    when(key.created_at),
    when(key.last_used_at),
    key.revoked_at ? h("span", { class: "badge revoked" }, `revoked ${when(key.revoked_at)}`) : revokeButton(key, onChanged),
  ]);
  const list = table(["Name", "Prefix", "Scopes", "Created", "Last used", "Status"], rows, { "data-table": "api-keys" });
  return h("div", {}, form, created, list);
}

function revokeButton(key: ApiKey, onChanged: () => void): HTMLElement {
  const button = twoStepButton("Revoke", { "data-revoke": key.id },
    () => api("POST", `/api-keys/${encodeURIComponent(key.id)}/revoke`), onChanged);
  return h("span", {}, h("span", { class: "badge active" }, "active"), " ", button);
}
