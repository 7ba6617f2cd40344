import { api, get } from "../api";
import { count, h, table, twoStepButton } from "../format";
import type { Fleet, ListPage, Worker } from "../types";

function age(iso: string): string {
  const seconds = Math.max(0, Math.round((Date.now() - new Date(iso).getTime()) / 1000));
  return seconds < 120 ? `${seconds} s ago` : `${Math.round(seconds / 60)} min ago`;
}

// A live worker can be drained: it finishes its work and takes none (POST /workers/{id}/drain).
function drainButton(worker: Worker, onChanged: () => void): HTMLElement | string {
  if (worker.state === "draining" || worker.state === "dead") return "";
  return twoStepButton("Drain", { "data-drain": worker.id },
    () => api("POST", `/workers/${encodeURIComponent(worker.id)}/drain`), onChanged);
}

// Staff only: fleets and their workers with live state and load.
export async function fleetView(onChanged: () => void): Promise<HTMLElement> {
  const [fleets, workers] = await Promise.all([
    get<ListPage<Fleet>>("/fleets?limit=200").then((page) => page.data),
    get<ListPage<Worker>>("/workers?limit=500").then((page) => page.data),
  ]);
  return h("div", {},
    table(
      ["Fleet", "Role", "Model", "Region", "Hardware", "Workers ready"],
      fleets.map((fleet) => [fleet.name, fleet.role, fleet.model, fleet.region, fleet.hardware_class,
        workers.filter((worker) => worker.fleet === fleet.name && worker.state === "ready").length]),
      { "data-table": "fleets" },
    ),
    table(
      ["Worker", "Fleet", "Role", "State", "Queue", "Active", "KV blocks free", "Tokens/s", "Last heartbeat", ""],
      workers.map((worker) => [
        worker.name, worker.fleet, worker.role,
        h("span", { class: `badge ${worker.state}` }, worker.state),
        count(worker.queue_depth), count(worker.active_sequences),
        `${count(worker.kv_blocks_free)} / ${count(worker.kv_blocks_total)}`,
        worker.tokens_per_second.toFixed(1), age(worker.last_heartbeat_at), drainButton(worker, onChanged),
      ]),
      { "data-table": "workers" },
    ),
  );
}
