// The page of `swarm serve`: jobs, a swarm's live tree of agents, an agent's conversation,
// result and changes, approvals, cancel, submit. Plain script, no build step.
//
// Every request carries the bearer token typed in (kept in sessionStorage: never a cookie,
// never in a URL). Text from the swarm (tasks, commands, outputs, model text, labels) is
// only ever set with textContent. A swarm's tree follows its event stream (fetch with a
// streaming body: EventSource cannot send the token), each event changing the one row it
// names; the snapshot is read again at most once a second to catch up.
"use strict";

(() => {
  const TOKEN_KEY = "swarm-token";
  const ID = /^[A-Za-z0-9_-]{1,64}$/;
  const SETTLED = new Set(["done", "failed", "cancelled", "timed_out", "refused"]);
  const FAILED = new Set(["failed", "timed_out", "cancelled", "refused"]);
  const SNAPSHOT_EVERY = 1000;  // ms between snapshot reads, at most
  const IDLE_EVERY = 2000;      // ms between reads while no event comes (times tick)
  const PANEL_EVERY = 1000;     // ms between reads of the selected agent
  const DIFF_LINES = 3000;      // diff lines coloured one by one; the rest as one text

  // Figures for tests and benchmarks: events applied and the time it took.
  const stats = window.swarmStats = {
    events: 0, eventMs: 0, eventMaxMs: 0, snapshots: 0, snapshotMs: 0, snapshotMaxMs: 0,
    firstRenderMs: 0, rows: 0, connects: 0,
  };

  const $ = (id) => document.getElementById(id);
  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }

  // -- numbers as the terminal views show them --------------------------------------------
  function duration(s) {
    s = Math.max(0, s || 0);
    if (s < 60) return s.toFixed(1) + "s";
    if (s < 3600) return Math.floor(s / 60) + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
    return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  }
  function tokens(n) {
    n = n || 0;
    if (n < 1000) return String(n);
    if (n < 1e6) return (n / 1000).toFixed(1) + "k";
    return (n / 1e6).toFixed(2) + "M";
  }
  function cost(c) {
    if (c === null || c === undefined) return "";
    return c < 1 ? "$" + c.toFixed(4) : "$" + c.toFixed(2);
  }
  function firstLine(text, width) {
    const line = (String(text || "").split("\n").find((l) => l.trim()) || "").trim();
    return line.length <= width ? line : line.slice(0, width - 3) + "...";
  }
  function when(ts) { return ts ? new Date(ts * 1000).toLocaleString() : ""; }

  // -- the API ----------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, detail) { super(detail); this.status = status; }
  }
  function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }
  function headers(extra) {
    return Object.assign({ Authorization: "Bearer " + token() }, extra || {});
  }
  function detailOf(body, status) {
    if (body && typeof body.detail === "string") return body.detail;
    if (body && Array.isArray(body.detail)) return body.detail.map((d) => d.msg).join("; ");
    return "HTTP " + status;
  }
  async function api(path, options) {
    options = options || {};
    const init = { method: options.method || "GET", cache: "no-store",
      headers: headers(options.body !== undefined ? { "Content-Type": "application/json" } : {}) };
    if (options.body !== undefined) init.body = JSON.stringify(options.body);
    const response = await fetch(path, init);
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (response.status === 401) { needToken("the token was refused: " + detailOf(body, 401)); }
    if (!response.ok) throw new ApiError(response.status, detailOf(body, response.status));
    return body;
  }

  // -- the token --------------------------------------------------------------------------
  function needToken(message) {
    sessionStorage.removeItem(TOKEN_KEY);
    stopWatching();
    show("login");
    $("login-error").textContent = message || "";
    $("logout").hidden = true;
  }
  $("login-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const given = $("token").value.trim();
    if (!given) return;
    sessionStorage.setItem(TOKEN_KEY, given);
    $("token").value = "";
    try {
      await api("/v1/jobs?limit=1");
    } catch (e) {
      if (e.status !== 401) $("login-error").textContent = e.message;
      return;
    }
    $("login-error").textContent = "";
    route();
  });
  $("logout").addEventListener("click", () => needToken(""));

  // -- views ------------------------------------------------------------------------------
  const VIEWS = ["login", "jobs", "swarm"];
  function show(name) {
    for (const view of VIEWS) $(view).hidden = view !== name;
  }
  function setConn(text, cls) {
    const node = $("conn");
    node.textContent = text;
    node.className = "conn " + (cls || "");
  }

  let watching = null;   // the swarm view's Watch
  let jobsTimer = null;
  function stopWatching() {
    if (watching) { watching.stop(); watching = null; }
    if (jobsTimer) { clearInterval(jobsTimer); jobsTimer = null; }
  }

  function route() {
    if (!token()) { needToken(""); return; }
    $("logout").hidden = false;
    const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean);
    if (parts[0] === "job" && ID.test(parts[1] || "")) {
      const agent = ID.test(parts[2] || "") ? parts[2] : "";
      if (!watching || watching.id !== parts[1]) {
        stopWatching();
        watching = new Watch(parts[1]);
        show("swarm");
        watching.start();
      }
      watching.select(agent);
      return;
    }
    stopWatching();
    show("jobs");
    $("where").textContent = "";
    setConn("");
    loadJobs();
    jobsTimer = setInterval(loadJobs, 3000);
  }
  window.addEventListener("hashchange", route);

  // -- approvals (both views) -------------------------------------------------------------
  function renderApprovals(box, list, after) {
    const key = list.map((a) => a.id).join(",");
    if (box.dataset.key === key) return;
    box.dataset.key = key;
    clear(box);
    if (!list.length) return;
    box.appendChild(el("h2", "", "Waiting for an answer (" + list.length + ")"));
    for (const approval of list) {
      const item = el("div", "approval");
      item.dataset.id = approval.id;
      const head = el("div", "approval-head");
      head.appendChild(el("span", "mono", approval.agent));
      head.appendChild(el("span", "tool", approval.tool));
      head.appendChild(el("span", "muted", approval.reason));
      item.appendChild(head);
      item.appendChild(el("pre", "text", approval.summary));
      const buttons = el("div", "actions");
      const message = el("span", "muted");
      for (const [decision, label] of [["approve", "Approve"], ["deny", "Deny"],
        ["always", "Always (this tool, whole job)"]]) {
        const button = el("button", "answer-" + decision, label);
        button.type = "button";
        button.addEventListener("click", async () => {
          for (const b of buttons.querySelectorAll("button")) b.disabled = true;
          try {
            await api("/v1/approvals/" + encodeURIComponent(approval.id) + "?job=" +
              encodeURIComponent(approval.job), { method: "POST", body: { decision } });
            message.textContent = decision + ": sent";
          } catch (e) {
            message.textContent = e.message;
          }
          if (after) after();
        });
        buttons.appendChild(button);
      }
      buttons.appendChild(message);
      item.appendChild(buttons);
      box.appendChild(item);
    }
  }

  // -- the jobs view ----------------------------------------------------------------------
  async function loadJobs() {
    let jobs, approvals;
    try {
      [jobs, approvals] = await Promise.all([api("/v1/jobs?limit=200"), api("/v1/approvals")]);
    } catch (e) {
      if (e.status !== 401) setConn(e.message, "bad");
      return;
    }
    if ($("jobs").hidden) return;
    setConn("");
    renderApprovals($("all-approvals"), approvals, loadJobs);
    const body = $("job-list").tBodies[0];
    const fragment = document.createDocumentFragment();
    for (const job of jobs) {
      const tr = el("tr");
      tr.dataset.id = job.id;
      const link = el("a", "mono", job.id);
      link.href = "#/job/" + job.id;
      const cell = el("td");
      cell.appendChild(link);
      tr.appendChild(cell);
      tr.appendChild(el("td", "", job.kind + (job.source ? " (" + job.source + ")" : "")));
      tr.appendChild(el("td", "state s-" + job.state, job.state));
      tr.appendChild(el("td", "num", job.agents));
      tr.appendChild(el("td", "", when(job.created)));
      tr.appendChild(el("td", "task", firstLine(job.task, 160)));
      fragment.appendChild(tr);
    }
    clear(body);
    body.appendChild(fragment);
    $("jobs-empty").hidden = jobs.length > 0;
  }

  $("submit-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = { task: $("task").value, approve: $("approve").value };
    const workspace = $("workspace").value.trim();
    if (workspace) body.workspace = workspace;
    $("submit-error").textContent = "";
    try {
      const created = await api("/v1/jobs", { method: "POST", body });
      $("task").value = "";
      location.hash = "#/job/" + created.id;
    } catch (e) {
      $("submit-error").textContent = e.message;
    }
  });

  // -- one swarm, live ----------------------------------------------------------------------
  const CELLS = ["agent", "state", "depth", "time", "turns", "tokens", "cost", "landing", "last"];
  const EVENT_FIELDS = ["state", "last", "landing", "error"];

  // Rows' new texts are written together, at most every WRITE_EVERY ms: the browser lays
  // the tree out once for a burst of events, not once per frame.
  const WRITE_EVERY = 200;
  let unwritten = [];
  let writeTimer = null;
  function later(row) {
    unwritten.push(row);
    if (writeTimer === null) {
      writeTimer = setTimeout(() => requestAnimationFrame(() => {
        writeTimer = null;
        const rows = unwritten;
        unwritten = [];
        for (const r of rows) r.write();
      }), WRITE_EVERY);
    }
  }

  class Row {
    constructor(watch, data) {
      this.watch = watch;
      this.id = data.id;
      this.data = {};
      this.kids = [];
      this.shown = {};
      this.touched = 0;  // the sequence number of the last event that changed it
      this.pending = null;  // texts to write (later)
      this.tr = el("tr");
      this.tr.dataset.id = data.id;
      this.cells = {};
      for (const name of CELLS) {
        const td = el("td", "c-" + name);
        this.cells[name] = td;
        this.tr.appendChild(td);
      }
      this.name = el("span", "mono", data.id);
      this.label = el("span", "label");
      this.cells.agent.appendChild(this.name);
      this.cells.agent.appendChild(this.label);
      this.tr.addEventListener("click", () => { location.hash = "#/job/" + watch.id + "/" + this.id; });
      this.update(data);
      this.write();  // a new row is drawn whole at once
    }
    set(name, text) {
      if (this.shown[name] === text) return;
      this.shown[name] = text;
      if (!this.pending) { this.pending = {}; later(this); }
      this.pending[name] = text;
    }
    write() {
      if (!this.pending) return;
      for (const [name, text] of Object.entries(this.pending)) {
        if (name === "agent") this.label.textContent = text;
        else if (name === "stateClass") {
          this.cells.state.className = "c-state state s-" + (text || "unknown");
          this.tr.classList.toggle("failed", FAILED.has(text));
        } else if (name === "indent") this.cells.agent.style.paddingLeft = text;
        else this.cells[name].textContent = text;
      }
      this.pending = null;
    }
    // From a snapshot read before this row's last event: that event's fields stay.
    merge(fields, asked) {
      if (this.touched > asked) {
        fields = Object.assign({}, fields);
        for (const name of EVENT_FIELDS) delete fields[name];
      }
      this.update(fields);
    }
    update(fields) {
      Object.assign(this.data, fields);
      const d = this.data;
      const usage = d.usage || {};
      this.set("agent", (d.type ? "[" + d.type + "] " : "") + (d.label || ""));
      this.set("state", d.state || "?");
      this.set("stateClass", d.state);
      this.set("depth", d.depth === undefined ? "" : String(d.depth));
      this.set("time", d.elapsed === undefined ? "" : duration(d.elapsed));
      this.set("turns", d.turns ? String(d.turns) : "");
      this.set("tokens", usage.total_tokens ? tokens(usage.total_tokens) : "");
      this.set("cost", cost(d.cost));
      this.set("landing", d.landing || "");
      this.set("last", doing(d));
      this.set("indent", (d.depth || 0) * 1.2 + "em");
    }
    get settled() { return SETTLED.has(this.data.state); }
  }

  function doing(d) {
    if (FAILED.has(d.state) && d.error) return "error: " + firstLine(d.error, 200);
    if (d.last) return firstLine(d.last, 200);
    if (d.state === "parked") return "waiting for its children";
    if (d.state === "done" && d.answer) return "answer: " + firstLine(d.answer, 200);
    return "";
  }

  class Watch {
    constructor(id) {
      this.id = id;
      this.rows = new Map();
      this.order = [];
      this.lastId = "";
      this.seq = 0;  // events applied
      this.live = false;  // the event stream is connected
      this.stopped = false;
      this.ended = false;
      this.abort = new AbortController();
      this.loadedAt = 0;
      this.loadTimer = null;
      this.loading = null;
      this.idle = null;
      this.selected = "";
      this.panel = new Panel(this);
      this.approvalsAt = 0;
      this.approvalsTimer = null;
      this.failKey = "";
      clear($("tree").tBodies[0]);
      clear($("summary"));
      clear($("approvals"));
      delete $("approvals").dataset.key;
      clear($("failures"));
      $("failures").hidden = true;
      $("swarm-error").textContent = "";
      $("where").textContent = "job " + id;
    }

    async start() {
      const began = performance.now();
      await this.load();
      if (this.stopped) return;
      stats.firstRenderMs = performance.now() - began;
      this.refreshApprovals();
      this.idle = setInterval(() => { if (!this.ended) this.soon(); }, IDLE_EVERY);
      this.follow();
    }

    stop() {
      this.stopped = true;
      this.abort.abort();
      clearInterval(this.idle);
      clearTimeout(this.loadTimer);
      clearTimeout(this.approvalsTimer);
      this.panel.close();
    }

    select(agent) {
      this.selected = agent;
      for (const row of this.rows.values()) row.tr.classList.toggle("selected", row.id === agent);
      if (agent) this.panel.open(agent); else this.panel.close();
    }

    // The snapshot, at most once every SNAPSHOT_EVERY ms.
    soon() {
      if (this.loadTimer || this.stopped) return;
      const wait = Math.max(0, this.loadedAt + SNAPSHOT_EVERY - Date.now());
      this.loadTimer = setTimeout(() => { this.loadTimer = null; this.load(); }, wait);
    }

    async load() {
      if (this.loading) return this.loading;
      this.loadedAt = Date.now();
      const asked = this.seq;
      this.loading = (async () => {
        let snap;
        try {
          snap = await api("/v1/jobs/" + this.id + "/snapshot");
        } catch (e) {
          if (e.status === 404) {
            $("swarm-error").textContent = "No job " + this.id + " that this token may see.";
            this.stopped = true;
            setConn("");
          } else if (e.status !== 401 && this.live) {  // else the stream says why
            setConn("cannot read the swarm: " + e.message, "bad");
          }
          return;
        } finally {
          this.loading = null;
        }
        if (this.stopped) return;
        if (!this.lastId) this.lastId = snap.last_event;
        const began = performance.now();
        this.apply(snap, asked);
        const took = performance.now() - began;
        stats.snapshots += 1;
        stats.snapshotMs += took;
        stats.snapshotMaxMs = Math.max(stats.snapshotMaxMs, took);
      })();
      return this.loading;
    }

    apply(snap, asked) {
      const body = $("tree").tBodies[0];
      const ids = snap.agents.map((a) => a.id);
      let fresh = ids.length !== this.order.length;
      let stale = false;
      for (const agent of snap.agents) {
        let row = this.rows.get(agent.id);
        if (!row) {
          row = new Row(this, agent);
          row.tr.classList.toggle("selected", agent.id === this.selected);
          this.rows.set(agent.id, row);
          fresh = true;
        } else {
          if (row.touched > asked) stale = true;
          row.merge(agent, asked);
        }
        row.kids = agent.children || [];
      }
      if (!fresh) fresh = ids.some((id, i) => this.order[i] !== id);
      if (fresh) {  // new agents, or an order the events guessed differently
        const fragment = document.createDocumentFragment();
        for (const id of ids) fragment.appendChild(this.rows.get(id).tr);
        const kept = new Set(ids);
        for (const [id, row] of this.rows) {
          if (!kept.has(id)) { row.tr.remove(); this.rows.delete(id); }
        }
        body.appendChild(fragment);
        this.order = ids;
      }
      stats.rows = this.rows.size;
      if (stale) this.soon();  // rows that events changed meanwhile: read again
      this.summary(snap);
      this.failures(snap.agents);
      if (Date.now() - this.approvalsAt > 2000) this.refreshApprovals();
    }

    summary(snap) {
      const totals = snap.totals || {};
      const states = Object.entries(totals.states || {}).map(([s, n]) => n + " " + s).join(", ");
      const parts = ["swarm " + this.id + " " + (snap.swarm.state || "?"),
        totals.agents + " agent" + (totals.agents === 1 ? "" : "s") + ": " + states,
        tokens((totals.usage || {}).total_tokens) + " tokens"];
      if (totals.cost !== null && totals.cost !== undefined) parts.push("~" + cost(totals.cost));
      parts.push(duration(totals.wall) + " wall");
      const box = $("summary");
      clear(box);
      box.appendChild(el("div", "line", parts.join(" · ")));
      box.appendChild(el("div", "muted", "task: " + firstLine(snap.swarm.task || "", 300)));
      const cancel = el("button", "", "Cancel the job");
      cancel.type = "button";
      cancel.hidden = snap.swarm.state !== "running";
      cancel.addEventListener("click", async () => {
        cancel.disabled = true;
        try {
          await api("/v1/jobs/" + this.id + "/cancel", { method: "POST" });
        } catch (e) { $("swarm-error").textContent = e.message; }
      });
      box.appendChild(cancel);
    }

    failures(agents) {
      const failed = agents.filter((a) => FAILED.has(a.state));
      const key = failed.map((a) => a.id + a.state).join(",");
      if (key === this.failKey) return;
      this.failKey = key;
      const box = $("failures");
      clear(box);
      box.hidden = !failed.length;
      if (!failed.length) return;
      box.appendChild(el("h2", "", "Failures (" + failed.length + ")"));
      for (const agent of failed) {
        const line = el("div", "failure");
        const link = el("a", "mono", agent.id);
        link.href = "#/job/" + this.id + "/" + agent.id;
        line.appendChild(link);
        line.appendChild(el("span", "state s-" + agent.state, agent.state));
        line.appendChild(el("span", "label", agent.label));
        line.appendChild(el("span", "error", firstLine(agent.error, 300) || "(no error)"));
        box.appendChild(line);
      }
    }

    refreshApprovals() {
      if (this.approvalsTimer || this.stopped) return;
      const wait = Math.max(0, this.approvalsAt + 500 - Date.now());
      this.approvalsTimer = setTimeout(async () => {
        this.approvalsTimer = null;
        this.approvalsAt = Date.now();
        try {
          const list = await api("/v1/approvals?job=" + this.id);
          if (!this.stopped) renderApprovals($("approvals"), list, () => this.refreshApprovals());
        } catch (e) { /* shown by the next snapshot read */ }
      }, wait);
    }

    // -- the event stream -------------------------------------------------------------
    async follow() {
      let delay = 500;
      let connected = false;
      while (!this.stopped) {
        try {
          const extra = this.lastId ? { "Last-Event-ID": this.lastId } : {};
          const response = await fetch("/v1/jobs/" + this.id + "/events",
            { headers: headers(extra), signal: this.abort.signal, cache: "no-store" });
          if (response.status === 401) { needToken("the token was refused"); return; }
          if (response.status === 404) {
            $("swarm-error").textContent = "No job " + this.id + " that this token may see.";
            return;
          }
          if (!response.ok) throw new Error("HTTP " + response.status);
          stats.connects += 1;
          this.live = true;
          if (connected) this.soon();  // back after a break: catch up
          connected = true;
          delay = 500;
          setConn("live", "ok");
          if (await this.read(response)) return;
        } catch (e) {
          if (this.stopped) return;
        }
        this.live = false;
        const seconds = Math.round(delay / 100) / 10;
        setConn("disconnected; trying again in " + seconds + " s", "bad");
        await sleep(delay);
        delay = Math.min(delay * 2, 10000);
      }
    }

    // Read one response of the stream; true once the job has settled.
    async read(response) {
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return false;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const kind = this.block(block);
          if (kind === "end") { this.end(); return true; }
          if (kind === "stopping") return false;
          if (kind === "error") throw new Error("the stream broke");
        }
      }
    }

    block(text) {
      let id = "", kind = "", data = "";
      for (const line of text.split("\n")) {
        if (!line || line[0] === ":") continue;
        const at = line.indexOf(":");
        const name = at < 0 ? line : line.slice(0, at);
        const value = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
        if (name === "id") id = value;
        else if (name === "event") kind = value;
        else if (name === "data") data += (data ? "\n" : "") + value;
      }
      if (kind === "end") {
        // The service stopping ends the stream, not the job: follow it again.
        let reason = "";
        try { reason = JSON.parse(data).reason || ""; } catch (e) { /* an older service */ }
        return reason === "server stopping" ? "stopping" : "end";
      }
      if (kind === "error") return kind;
      if (!data) return kind;
      if (id) this.lastId = id;
      let event;
      try { event = JSON.parse(data); } catch (e) { return kind; }
      const began = performance.now();
      this.event(event);
      const took = performance.now() - began;
      stats.events += 1;
      stats.eventMs += took;
      stats.eventMaxMs = Math.max(stats.eventMaxMs, took);
      return kind;
    }

    end() {
      this.ended = true;
      setConn("settled", "");
      clearInterval(this.idle);
      this.soon();
      if (this.selected) this.panel.soon();
    }

    // One event: the row it names changes, nothing else is drawn again.
    event(ev) {
      const id = ev.agent;
      let row = this.rows.get(id);
      this.seq += 1;
      switch (ev.kind) {
        case "queued":
          if (!row) row = this.add(id, ev.parent, Number(ev.depth) || 0);
          else row.update({ state: "queued" });
          break;
        case "tool":
          if (row) row.update(row.settled ? { last: ev.text } : { last: ev.text, state: "running" });
          break;
        case "settled":
          if (row) row.update({ state: ev.state, error: ev.error || row.data.error });
          break;
        case "landed":
          if (row) row.update({ landing: ev.landing });
          break;
        case "parked":
          if (row) row.update({ state: "parked", last: "" });
          break;
        case "joined":
          if (row) row.update({ state: "running", last: "resumed with its children's results" });
          break;
        case "spawn":
        case "dispatched":
          if (row) row.update({ last: ev.kind + " " + ev.children + " children" });
          break;
        case "approval":
          if (row) row.update({ last: "asks: " + firstLine(ev.text, 200) });
          this.refreshApprovals();
          break;
        case "takeover":
          if (row) row.update({ last: "taken over by another worker" });
          break;
        case "cancel":
          if (row) row.update({ last: "cancel: " + firstLine(ev.text, 200) });
          break;
        case "message":
          if (row) row.update({ last: "told: " + firstLine(ev.text, 200) });
          break;
        default:
          break;
      }
      if (row) row.touched = this.seq;
      if (id && id === this.selected) this.panel.soon();
      this.soon();
    }

    // A new agent, placed after its parent's last descendant until the snapshot says.
    add(id, parentId, depth) {
      const row = new Row(this, { id, parent: parentId, depth, state: "queued" });
      this.rows.set(id, row);
      const parent = this.rows.get(parentId);
      const body = $("tree").tBodies[0];
      if (parent) {
        let last = parent;
        while (last.kids.length && this.rows.get(last.kids[last.kids.length - 1])) {
          last = this.rows.get(last.kids[last.kids.length - 1]);
        }
        parent.kids = parent.kids.concat([id]);
        last.tr.after(row.tr);
      } else {
        body.appendChild(row.tr);
      }
      this.order = [];  // the next snapshot sets the order
      stats.rows = this.rows.size;
      return row;
    }
  }

  // -- the selected agent -------------------------------------------------------------------
  class Panel {
    constructor(watch) {
      this.watch = watch;
      this.agent = "";
      this.at = 0;
      this.timer = null;
      this.diffFor = "";
      this.convKey = "";
    }

    open(agent) {
      if (agent !== this.agent) {
        this.agent = agent;
        this.diffFor = "";
        this.convKey = "";
        for (const id of ["p-id", "p-state", "p-task", "p-result", "p-diff", "p-stat",
          "p-earlier", "p-cancel-msg", "p-say-msg"]) $(id).textContent = "";
        $("p-say-text").value = "";
        clear($("p-conv"));
        clear($("p-facts"));
        $("p-cancel-sure").hidden = true;
        $("p-cancel").hidden = false;
      }
      $("panel").hidden = false;
      this.load();
    }

    close() {
      this.agent = "";
      clearTimeout(this.timer);
      this.timer = null;
      $("panel").hidden = true;
    }

    soon() {
      if (this.timer || !this.agent) return;
      const wait = Math.max(0, this.at + PANEL_EVERY - Date.now());
      this.timer = setTimeout(() => { this.timer = null; this.load(); }, wait);
    }

    async load() {
      const agent = this.agent;
      if (!agent) return;
      this.at = Date.now();
      let detail;
      try {
        detail = await api("/v1/jobs/" + this.watch.id + "/agents/" + agent + "?tail=60");
      } catch (e) {
        if (agent === this.agent) $("p-result").textContent = e.message;
        return;
      }
      if (agent !== this.agent || this.watch.stopped) return;
      this.render(detail);
      const a = detail.agent;
      if (SETTLED.has(a.state) && this.diffFor !== agent + a.settled) {
        this.diffFor = agent + a.settled;
        this.diff(agent);
      }
    }

    render(detail) {
      const a = detail.agent;
      const row = this.watch.rows.get(a.id);
      const live = row ? row.data : a;  // the tree's figures are the swarm's (usage of runs)
      $("p-id").textContent = a.id;
      $("p-state").textContent = a.state;
      $("p-state").className = "state s-" + a.state;
      const facts = $("p-facts");
      clear(facts);
      const usage = live.usage || a.usage || {};
      for (const [name, value] of [["label", a.label], ["kind", a.kind], ["type", a.type || ""],
        ["depth", a.depth],
        ["time", duration(live.elapsed === undefined ? a.elapsed : live.elapsed)],
        ["turns", live.turns || a.turns], ["tokens", tokens(usage.total_tokens)],
        ["cost", cost(live.cost === undefined ? a.cost : live.cost)],
        ["landing", a.landing || ""], ["host", a.host], ["workspace", a.workspace],
        ["parent", a.parent || ""]]) {
        if (value === "" || value === null || value === undefined) continue;
        facts.appendChild(el("dt", "", name));
        facts.appendChild(el("dd", "", value));
      }
      $("p-task").textContent = a.task || "";
      const active = !SETTLED.has(a.state);
      $("p-cancel").disabled = !active;
      $("p-say").hidden = !active;  // a settled agent reads no more messages
      $("p-earlier").textContent = detail.earlier ? "(" + detail.earlier + " earlier entries not shown)" : "";
      const key = JSON.stringify(detail.conversation);
      if (key !== this.convKey) {
        this.convKey = key;
        const box = $("p-conv");
        const atEnd = box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
        clear(box);
        for (const entry of detail.conversation) {
          const item = el("div", "entry k-" + entry.kind);
          item.appendChild(el("div", "kind", entry.kind === "call" ? entry.tool : entry.kind));
          item.appendChild(el("pre", entry.kind === "call" ? "cmd" : "text", entry.text));
          if (entry.kind === "call") {
            item.appendChild(el("pre", "out", entry.output === null ? "(running)" : entry.output));
          }
          box.appendChild(item);
        }
        if (atEnd) box.scrollTop = box.scrollHeight;
      }
      $("p-result").textContent = detail.result ? JSON.stringify(detail.result, null, 1) : "(not settled yet)";
    }

    async diff(agent) {
      let got;
      try {
        got = await api("/v1/jobs/" + this.watch.id + "/agents/" + agent + "/diff");
      } catch (e) {
        if (agent === this.agent) $("p-diff").textContent = e.message;
        return;
      }
      if (agent !== this.agent) return;
      $("p-stat").textContent = got.stat + (got.truncated ? " (cut)" : "");
      const box = $("p-diff");
      clear(box);
      if (!got.diff) { box.textContent = got.note; return; }
      const lines = got.diff.split("\n");
      const fragment = document.createDocumentFragment();
      lines.slice(0, DIFF_LINES).forEach((line) => {
        const c = line[0];
        const cls = line.startsWith("+++") || line.startsWith("---") ? "file"
          : c === "+" ? "add" : c === "-" ? "del" : c === "@" ? "hunk" : line.startsWith("diff ") ? "file" : "";
        fragment.appendChild(el("span", cls, line + "\n"));
      });
      if (lines.length > DIFF_LINES) fragment.appendChild(el("span", "", lines.slice(DIFF_LINES).join("\n")));
      if (got.truncated) fragment.appendChild(el("span", "muted", "\n... cut: the diff is longer\n"));
      box.appendChild(fragment);
    }
  }

  // Cancel: a first click asks, a second does it.
  $("p-cancel").addEventListener("click", () => {
    if (!watching || !watching.panel.agent) return;
    const agent = watching.panel.agent;
    let count = 0;
    const todo = [agent];
    while (todo.length) {
      const row = watching.rows.get(todo.pop());
      if (!row) continue;
      if (!row.settled) count += 1;
      todo.push(...row.kids);
    }
    const sure = $("p-cancel-sure");
    sure.textContent = "Cancel " + count + " active agent" + (count === 1 ? "" : "s") + " now";
    sure.hidden = false;
    $("p-cancel").hidden = true;
  });
  $("p-cancel-sure").addEventListener("click", async () => {
    if (!watching || !watching.panel.agent) return;
    const agent = watching.panel.agent;
    $("p-cancel-sure").hidden = true;
    $("p-cancel").hidden = false;
    try {
      const done = await api("/v1/jobs/" + watching.id + "/agents/" + agent + "/cancel",
        { method: "POST" });
      $("p-cancel-msg").textContent = "cancelled: " + done.flagged.length + " agent" +
        (done.flagged.length === 1 ? "" : "s") + " stopping";
    } catch (e) {
      $("p-cancel-msg").textContent = e.message;
    }
  });
  // A message to the selected agent: it reads it at its next turn boundary.
  $("p-say").addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!watching || !watching.panel.agent) return;
    const agent = watching.panel.agent;
    const text = $("p-say-text").value;
    if (!text.trim()) return;
    $("p-say-send").disabled = true;
    try {
      await api("/v1/jobs/" + watching.id + "/agents/" + agent + "/messages",
        { method: "POST", body: { text } });
      if (agent === watching.panel.agent) {
        $("p-say-text").value = "";
        $("p-say-msg").textContent = "sent: it reads it at its next turn";
      }
    } catch (e) {
      if (agent === watching.panel.agent) $("p-say-msg").textContent = e.message;
    } finally {
      $("p-say-send").disabled = false;
    }
  });
  $("p-close").addEventListener("click", () => {
    if (watching) location.hash = "#/job/" + watching.id;
  });

  route();
})();
