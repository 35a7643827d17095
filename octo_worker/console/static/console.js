// octo-worker console, live view: polls /live.json and rewrites its tables.
// Every value is written with textContent (never as markup); nothing is sent
// but GET requests to this origin.
"use strict";
(function () {
  const root = document.getElementById("live");
  if (!root) { return; }
  const seconds = Math.max(1, parseInt(root.dataset.pollSeconds || "2", 10));
  const previous = { deliveries: new Map(), rejected: new Map() };

  function cell(text, numeric) {
    const td = document.createElement("td");
    td.textContent = String(text);
    if (numeric) { td.className = "num"; }
    return td;
  }

  function fill(tableId, byScope, memory) {
    const body = document.querySelector("#" + tableId + " tbody");
    const rows = [];
    for (const scope of Object.keys(byScope).sort()) {
      for (const label of Object.keys(byScope[scope]).sort()) {
        const count = Math.round(Number(byScope[scope][label]));
        const id = scope + "\u0000" + label;
        const before = memory.get(id);
        memory.set(id, count);
        const tr = document.createElement("tr");
        tr.append(cell(scope), cell(label), cell(count, true),
                  cell(before === undefined ? "-" : "+" + (count - before), true));
        rows.push(tr);
      }
    }
    body.replaceChildren(...rows);
  }

  function queues(byQueue) {
    const body = document.querySelector("#live-queues tbody");
    const rows = [];
    for (const name of Object.keys(byQueue).sort()) {
      const counts = byQueue[name];
      const tr = document.createElement("tr");
      tr.append(cell(name),
                cell("messages" in counts ? Math.round(counts.messages) : "-", true),
                cell(Math.round(counts.consumers || 0), true));
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  function when(epoch) {
    return epoch ? new Date(epoch * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "-";
  }

  async function poll() {
    const status = document.getElementById("live-status");
    try {
      const response = await fetch("/live.json", { cache: "no-store", credentials: "same-origin" });
      if (!response.ok) { throw new Error("HTTP " + response.status); }
      const live = await response.json();
      document.getElementById("live-source").textContent = "Source: " + live.source;
      if (!live.available) {
        status.className = "warn";
        status.textContent = "Unavailable: " + (live.error || "no source");
        return;
      }
      fill("live-deliveries", live.deliveries || {}, previous.deliveries);
      fill("live-rejected", live.rejected || {}, previous.rejected);
      queues(live.queues || {});
      document.getElementById("live-consumers").textContent =
        live.consumers_active === null ? "-" : String(Math.round(live.consumers_active));
      document.getElementById("live-progress").textContent = when(live.last_progress);
      status.className = "ok";
      status.textContent = "Updated " + when(live.taken_at) + " (every " + seconds + " s)";
    } catch (error) {
      status.className = "warn";
      status.textContent = "Console unreachable: " + error.message;
    }
  }

  function tick() {
    if (!document.hidden) { poll(); }
  }
  poll();
  setInterval(tick, seconds * 1000);
}());
