import { api, get } from "../api";
import { count, errorText, h, table, when } from "../format";
import type { Batch, BatchList } from "../types";

const BATCH_ROLES = ["owner", "admin", "developer"];
const CANCELLABLE = ["validating", "in_progress"];

const moment = (seconds: number | null) => (seconds === null ? "—" : when(new Date(seconds * 1000).toISOString()));

// A file of the batch, opened through the control plane (the session's cookie reads the organization's files).
const fileLink = (id: string | null, label: string) =>
  id === null ? null : h("a", { href: `/api/v1/files/${encodeURIComponent(id)}/content`, download: `${id}.jsonl` }, label);

export function canSeeBatches(role: string | null): boolean {
  return role !== null && BATCH_ROLES.includes(role);
}

// The organization's batches (Batch API): status, requests done and failed, result files; a running batch can be cancelled.
export async function batchesView(onChanged: () => void): Promise<HTMLElement> {
  const batches = (await get<BatchList>("/batches?limit=50")).data;
  if (batches.length === 0) {
    return h("p", { class: "muted" }, "No batch yet: upload a JSON Lines file of requests (POST /v1/files) and create a batch (POST /v1/batches). Batch requests are billed at the batch price.");
  }
  const message = h("p", { class: "error", role: "alert" });
  const rows = batches.map((batch) => [
    h("code", {}, batch.id),
    h("span", { class: `badge ${batch.status}`, "data-status": batch.status }, batch.status.replace("_", " ")),
    batch.endpoint,
    `${count(batch.request_counts.completed)} / ${count(batch.request_counts.total)}`,
    count(batch.request_counts.failed),
    moment(batch.created_at),
    h("span", {}, fileLink(batch.output_file_id, "output"), " ", fileLink(batch.error_file_id, "errors")),
    CANCELLABLE.includes(batch.status) ? cancelButton(batch, message, onChanged) : null,
  ]);
  return h("div", {},
    table(["Batch", "Status", "Endpoint", "Done / total", "Failed", "Created", "Files", ""], rows, { "data-table": "batches" }),
    message);
}

function cancelButton(batch: Batch, message: HTMLElement, onChanged: () => void): HTMLElement {
  const button = h("button", { type: "button", class: "link", "aria-label": `Cancel ${batch.id}` }, "Cancel");
  button.addEventListener("click", async () => {
    message.textContent = "";
    try {
      await api("POST", `/batches/${encodeURIComponent(batch.id)}/cancel`);
      onChanged();
    } catch (error) {
      message.textContent = errorText(error);
    }
  });
  return button;
}
