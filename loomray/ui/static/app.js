// The session page's live updates: journal entries and status over server-sent events.
// Entries are added with textContent only (never as HTML); an entry already on the page is never added twice.
// After a new checkpoint or status the page's own HTML is fetched again and its transcript and actions swapped in.
"use strict";

(function () {
  const page = document.getElementById("session");
  if (!page || !window.EventSource) return;
  const events = document.getElementById("events");
  const live = document.getElementById("live");
  let shown = { status: page.dataset.status, checkpoint: page.dataset.checkpoint };
  let url = page.dataset.events;
  if (page.dataset.after) url += (url.includes("?") ? "&" : "?") + "after=" + encodeURIComponent(page.dataset.after);

  function addEntry(e) {
    if (events.querySelector(`li[data-id="${CSS.escape(e.id)}"]`)) return;
    const li = document.createElement("li");
    li.dataset.id = e.id;
    li.className = "ev-" + e.kind;
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = e.at + " " + e.kind;
    li.append(meta, " " + e.summary);
    events.append(li);
  }

  async function refresh() {
    const res = await fetch(window.location.pathname + window.location.search, { credentials: "same-origin" });
    if (!res.ok) return;
    const doc = new DOMParser().parseFromString(await res.text(), "text/html");
    for (const id of ["transcript", "act"]) {
      const fresh = doc.getElementById(id);
      const old = document.getElementById(id);
      if (fresh && old) old.replaceWith(fresh);
    }
    for (const id of ["spend-chart", "incarnations", "fork-tree"]) {
      const fresh = doc.getElementById(id);
      const old = document.getElementById(id);
      if (fresh && old) old.replaceWith(fresh);
    }
  }

  const source = new EventSource(url);
  source.addEventListener("open", () => { live.classList.add("on"); });
  source.addEventListener("error", () => { live.classList.remove("on"); });
  source.addEventListener("entry", (m) => addEntry(JSON.parse(m.data)));
  source.addEventListener("status", (m) => {
    const s = JSON.parse(m.data);
    document.getElementById("status").textContent = s.status;
    document.getElementById("status").className = "s-" + s.status;
    if (s.turn !== null) document.getElementById("turn").textContent = s.turn;
    if (s.cost_usd !== null) document.getElementById("spend").textContent = "$" + s.cost_usd.toFixed(4);
    if (s.status !== shown.status || (s.checkpoint_id || "") !== shown.checkpoint) {
      shown = { status: s.status, checkpoint: s.checkpoint_id || "" };
      refresh();
    }
  });
})();
