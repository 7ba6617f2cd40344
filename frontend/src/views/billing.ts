import { api, get } from "../api";
import { errorText, h, periodText, usd, when } from "../format";
import type { BillingCurrent } from "../types";

// Cost to date, projection, spend limit (editable by those allowed to) and the alerts it triggered.
export async function billingView(onChanged: () => void): Promise<HTMLElement> {
  const billing = await get<BillingCurrent>("/billing/current");
  const limitInput = h("input", {
    type: "number", min: "0", step: "any", name: "limit", placeholder: "no limit",
    value: billing.spend_limit_micros === null ? "" : String(billing.spend_limit_micros / 1_000_000),
  });
  const message = h("p", { class: "error", role: "alert" });
  const form = h("form", { class: "inline", "aria-label": "Spend limit" },
    h("label", {}, "Spend limit per period (USD)", limitInput),
    h("button", { type: "submit" }, "Save"),
    message,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = limitInput.value.trim();
    try {
      await api("PUT", "/spend-limit", { limit_micros: text === "" ? null : Math.round(Number(text) * 1_000_000) });
      onChanged();
    } catch (error) {
      message.textContent = errorText(error);
    }
  });
  const used = billing.spend_limit_micros ? Math.min(100, (100 * billing.amount_to_date_micros) / billing.spend_limit_micros) : null;
  return h("div", {},
    h("div", { class: "cards" },
      h("div", { class: "card stat", "data-billing": "to-date" }, h("span", {}, "Cost to date"), h("strong", {}, usd(billing.amount_to_date_micros))),
      h("div", { class: "card stat", "data-billing": "projected" }, h("span", {}, "Projected for the period"), h("strong", {}, usd(billing.projected_micros))),
      h("div", { class: "card stat" }, h("span", {}, "Period"), h("strong", { "data-billing": "period" }, periodText(billing.period_start, billing.period_end))),
      h("div", { class: "card stat" }, h("span", {}, "Spend limit"),
        h("strong", {}, billing.spend_limit_micros === null ? "none" : usd(billing.spend_limit_micros)),
        used === null ? null : h("progress", { max: "100", value: String(used) }),
      ),
    ),
    form,
    billing.alerts.length === 0
      ? h("p", { class: "muted" }, "No spend alert this period.")
      : h("ul", { class: "alerts" }, ...billing.alerts.map((alert) =>
          h("li", {}, `${alert.threshold_percent}% of the spend limit reached on ${when(alert.triggered_at)}`))),
  );
}
