import { api } from "../api";
import { errorText, h } from "../format";
import type { Me } from "../types";

export function loginView(onSignedIn: (me: Me) => void): HTMLElement {
  const email = h("input", { type: "email", name: "email", autocomplete: "username", required: true });
  const password = h("input", { type: "password", name: "password", autocomplete: "current-password", required: true });
  const message = h("p", { class: "error", role: "alert" });
  const form = h(
    "form",
    { class: "card login", "aria-label": "Sign in" },
    h("h1", {}, "Diptych"),
    h("p", { class: "muted" }, "Sign in with your organization account."),
    h("label", {}, "Email", email),
    h("label", {}, "Password", password),
    h("button", { type: "submit" }, "Sign in"),
    message,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    message.textContent = "";
    try {
      const { user } = await api<{ user: Me }>("POST", "/auth/login", { email: email.value, password: password.value });
      onSignedIn(user);
    } catch (error) {
      message.textContent = errorText(error);
    }
  });
  return h("main", { class: "login-page" }, form);
}
