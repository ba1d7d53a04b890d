// The live dashboard: reads the engine's events (GET /v1/engine/events, server-sent) and draws them.
// Events are applied as they come; drawing happens at most once per animation frame. `window.dashboard` exposes
// what is drawn (tests and curious readers read it from the browser's console).
"use strict";

const MAX_STEPS = 160;      // bars in the batch chart
const MAX_ROWS = 32;        // requests in the timeline
const MAX_KEPT = 400;       // finished requests remembered
const ROW = 18, LABEL = 90, NOTE = 300;

const view = {
  hello: null, steps: [], requests: new Map(), kv: null, kvCounts: null, owners: new Map(), counters: {},
  selected: null,  // the request whose blocks are outlined (the one under the pointer, in the pool or the timeline)
  updates: 0, draws: 0, drawMs: 0, errors: 0, frameMs: Number(new URLSearchParams(location.search).get("frame_ms") || 0), lastTime: 0, rates: {steps: 0, tokens: 0, updates: 0},
};
window.dashboard = view;
let tokensSeen = 0;  // tokens run in the steps applied so far (for the tokens-run-per-second counter)

// -------------------------------------------------------------------------------- colours
function hash(text) {
  let h = 2166136261;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619);
  return h >>> 0;
}
function hslToRgb(h, s, l) {
  const k = n => (n + h / 30) % 12, a = s * Math.min(l, 1 - l);
  const f = n => Math.round(255 * (l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)))));
  return [f(0), f(8), f(4)];
}
// A request's colour (its blocks and its timeline label): a hue from its id, as "rgb(r, g, b)".
const colours = new Map();
view.colourOf = id => {
  let colour = colours.get(id);
  if (colour === undefined) {
    const [r, g, b] = hslToRgb((hash(id) * 137.508) % 360, 0.62, 0.52);  // the golden angle spreads the hues
    colour = `rgb(${r}, ${g}, ${b})`;
    if (colours.size > 4096) colours.clear();
    colours.set(id, colour);
  }
  return colour;
};

// -------------------------------------------------------------------------------- applying events
// A request's entry; `arrival` (the engine's, when an event tells it) always wins over a first guess: a request
// can run, or even finish, before the event that lists it as running arrives.
function request(id, arrival) {
  let r = view.requests.get(id);
  if (!r) {
    r = {id, arrival: arrival ?? view.lastTime, segments: [], state: "queued", promptTokens: 0, outputTokens: 0,
         firstToken: null, end: null, reason: null, ttft: null, itl: null, blocks: 0};
    view.requests.set(id, r);
  } else if (arrival !== undefined && arrival !== null) {
    r.arrival = arrival;
  }
  return r;
}

function extend(r, kind, t0, t1) {
  const last = r.segments[r.segments.length - 1];
  if (last && last.kind === kind && t0 - last.t1 < 0.25) last.t1 = Math.max(last.t1, t1);
  else r.segments.push({kind, t0, t1});
}

function applyState(e) {
  view.lastTime = e.time;
  if (view.firstState) {  // requests that ran before this page subscribed (their steps were never sent here): one
    view.firstState = false;  // span each, from their first token to the first step this page is told about
    const seenFrom = e.steps.length ? e.steps[0].start : e.time;
    for (const s of e.running) {
      if (s.first_token !== null && s.first_token < seenFrom) extend(request(s.id, s.arrival), "earlier", s.first_token, seenFrom);
    }
  }
  for (const step of e.steps) {
    let prefill = 0, decode = 0, proposed = 0, kept = 0;
    const t1 = step.start + step.duration_ms / 1000;
    for (const [id, , p, d, dp, dk] of step.items) {
      prefill += p; decode += d; proposed += dp; kept += dk;
      const r = request(id);
      extend(r, p > 0 ? "prefill" : "decode", step.start, t1);
    }
    for (const [id] of step.preempted) {  // its blocks were freed at the step's start: it waits, then recomputes
      const r = request(id);
      r.state = "preempted"; r.preemptions = (r.preemptions || 0) + 1;
      extend(r, "preempted", step.start, step.start);
    }
    view.steps.push({step: step.step, start: step.start, ms: step.duration_ms, prefill, decode, proposed, kept});
    tokensSeen += prefill + decode;
  }
  if (view.steps.length > MAX_STEPS) view.steps.splice(0, view.steps.length - MAX_STEPS);
  const blocksOf = new Map();
  // A request of n > 1 completions is one row: running while any of them runs, its tokens summed.
  const outputTokens = new Map(), runningIds = new Set();
  for (const s of e.running) {
    const r = request(s.id, s.arrival);
    r.state = "running"; r.promptTokens = s.prompt_tokens; r.firstToken = s.first_token;
    runningIds.add(s.id);
    outputTokens.set(s.id, (outputTokens.get(s.id) || 0) + s.output_tokens);
    blocksOf.set(s.id, (blocksOf.get(s.id) || 0) + s.blocks.length);
  }
  for (const s of e.waiting) {
    const r = request(s.id, s.arrival);
    r.promptTokens = s.prompt_tokens;
    outputTokens.set(s.id, (outputTokens.get(s.id) || 0) + s.output_tokens);
    if (runningIds.has(s.id)) continue;  // a sibling still waits for its fork: the request runs
    if (s.preempted) { r.state = "preempted"; extend(r, "preempted", e.time, e.time); }
    else r.state = "queued";
  }
  for (const [id, n] of outputTokens) view.requests.get(id).outputTokens = n;
  for (const f of e.finished) {
    const r = request(f.id, f.arrival);
    r.state = f.reason === "abort" ? "aborted" : f.reason === "error" ? "failed" : "finished";
    r.end = e.time; r.reason = f.reason; r.ttft = f.ttft_ms; r.itl = f.itl_ms;
    if (f.output_tokens !== null) r.outputTokens = f.output_tokens;
  }
  for (const r of view.requests.values()) r.blocks = blocksOf.get(r.id) || 0;
  // Owners: the first running sequence whose table holds the block.
  view.owners = new Map();
  for (const s of e.running) for (const b of s.blocks) if (!view.owners.has(b)) view.owners.set(b, s.id);
  if (e.kv) {  // (a large pool's states come less often than the events)
    view.kv = e.kv;
    const counts = {".": 0, "c": 0, "u": 0, "s": 0};
    for (const state of e.kv.states) counts[state]++;
    view.kvCounts = counts;  // the header's and the pool's figures both come from these
  }
  view.counters = e.counters;
  const done = [...view.requests.values()].filter(r => r.end !== null);
  for (const r of done.slice(0, Math.max(0, done.length - MAX_KEPT))) view.requests.delete(r.id);
  view.updates++;
  schedule();
}

// -------------------------------------------------------------------------------- drawing
let pending = false, lastSlowDraw = -Infinity;
const SLOW_DRAW_MS = 250;
view.redraw = () => { lastSlowDraw = -Infinity; draw(); };  // draw now (what a test reads is then what the canvases show)
let lastFrame = -Infinity;
function schedule() {  // the next frame, no sooner than view.frameMs after the last one
  if (pending) return;
  pending = true;
  const wait = lastFrame + view.frameMs - performance.now();
  if (wait > 0) setTimeout(() => requestAnimationFrame(draw), wait);
  else requestAnimationFrame(draw);
}

function draw() {
  pending = false;
  const start = lastFrame = performance.now();
  try {
    // Every update: the step's bar, the pool and the counters (whose KV figures count the blocks the pool draws; only
    // the numbers whose text changed are written).
    drawBatch(); drawKV(); drawCounters();
    if (start - lastSlowDraw >= SLOW_DRAW_MS) {  // the timeline's rows: a few times a second is enough
      lastSlowDraw = start;
      drawTimeline();
    }
    view.draws++;
    view.drawMs += performance.now() - start;
  } catch (error) {
    view.errors++;
    console.error(error);
  }
}

// A canvas drawn at the screen's resolution: its CSS height is its height attribute's, its width its box's;
// [context, width, height, whether it was resized (and so cleared)].
function sizeCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  if (!canvas.dataset.height) { canvas.dataset.height = canvas.height; canvas.style.height = `${canvas.height}px`; }
  const width = canvas.clientWidth || canvas.width, height = Number(canvas.dataset.height);
  const resized = canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio);
  if (resized) {  // (which clears it)
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return [ctx, width, height, resized];
}

function drawCounters() {  // in place: only the numbers' text changes
  const c = view.counters, h = view.hello, kv = view.kv;
  const items = [["running", c.running], ["waiting", c.waiting], ["preemptions", c.preemptions],
    ["KV in use", kv ? `${view.kvCounts.u + view.kvCounts.s} / ${kv.num_blocks}` : "–"],
    ["KV cached", kv ? view.kvCounts.c : "–"],
    ["prefix hits", c.prefix_queried_tokens ? `${(100 * c.prefix_hit_tokens / c.prefix_queried_tokens).toFixed(1)} %` : "–"],
    ["steps", c.steps], ["steps/s", view.rates.steps.toFixed(1)], ["tokens run/s", view.rates.tokens.toFixed(0)],
    ["last step", view.steps.length ? `${view.steps[view.steps.length - 1].ms.toFixed(1)} ms` : "–"],
    ["updates/s", view.rates.updates.toFixed(1)]];
  if (h && h.speculative) {
    items.push(["drafts kept", c.draft_tokens ? `${(100 * c.accepted_tokens / c.draft_tokens).toFixed(1)} %` : "–"]);
  }
  if (c.failed_requests) items.push(["failed", c.failed_requests]);
  const list = document.getElementById("counters");
  for (const [name, value] of items) {
    let entry = list.querySelector(`[data-counter="${name}"] dd`);
    if (!entry) {
      const div = document.createElement("div");
      div.dataset.counter = name;
      div.innerHTML = `<dt>${name}</dt><dd></dd>`;
      list.appendChild(div);
      entry = div.querySelector("dd");
    }
    const text = String(value ?? "–");
    if (entry.textContent !== text) entry.textContent = text;
  }
}

function drawBatch() {
  const [ctx, width, height] = sizeCanvas(document.getElementById("batch-canvas"));
  ctx.clearRect(0, 0, width, height);
  const budget = view.hello ? view.hello.max_num_batched_tokens : 1;
  const top = 14, bottom = height - 16, scale = n => (bottom - top) * Math.sqrt(Math.min(n, budget) / budget);
  ctx.font = "10px system-ui"; ctx.fillStyle = "#6b7280"; ctx.strokeStyle = "#e3e6ea";
  for (const n of [16, 128, 512, budget]) {
    if (n > budget) continue;
    const y = bottom - scale(n);
    ctx.beginPath(); ctx.setLineDash(n === budget ? [4, 3] : []); ctx.moveTo(30, y); ctx.lineTo(width, y); ctx.stroke();
    ctx.fillText(n === budget ? `budget ${budget}` : String(n), 0, y - 2);
  }
  ctx.setLineDash([]);
  const barWidth = (width - 32) / MAX_STEPS, styles = getComputedStyle(document.documentElement);
  const colour = name => styles.getPropertyValue(name);
  view.steps.forEach((s, i) => {
    const x = 32 + i * barWidth, total = s.prefill + s.decode, h = scale(total);
    const parts = [["--prefill", s.prefill], ["--decode", s.decode - s.proposed],
                   ["--kept", s.kept], ["--rejected", s.proposed - s.kept]];
    let y = bottom;
    for (const [name, n] of parts) {
      if (n <= 0) continue;
      const part = h * n / total;
      ctx.fillStyle = colour(name);
      ctx.fillRect(x, y - part, Math.max(1, barWidth - 1), part);
      y -= part;
    }
  });
  ctx.fillStyle = "#6b7280";
  if (view.steps.length) ctx.fillText(`step ${view.steps[view.steps.length - 1].step}`, width - 60, height - 3);
}

// Where block `b` is drawn: the grid is as square as the canvas allows; a pool too large for cells of 2 pixels
// makes the canvas taller.
function kvGrid(width, height, n) {
  const cell = Math.max(2, Math.floor(Math.sqrt(width * height / n)));
  let size = cell;
  while (size > 2 && Math.floor(width / size) * Math.floor(height / size) < n) size--;
  const columns = Math.floor(width / size);
  return {size, columns, height: Math.max(height, Math.ceil(n / columns) * size)};
}
view.kvBlockAt = (x, y) => {  // the block under CSS pixel (x, y) of the KV canvas, or null
  const canvas = document.getElementById("kv-canvas"), kv = view.kv;
  if (!kv) return null;
  const g = kvGrid(canvas.clientWidth, Number(canvas.dataset.height), kv.num_blocks);
  const column = Math.floor(x / g.size), b = Math.floor(y / g.size) * g.columns + column;
  return column < g.columns && b >= 0 && b < kv.num_blocks ? b : null;
};
const STATE_NAMES = {".": "free", "c": "cached prefix, no holder", "u": "in use", "s": "shared"};
view.describeBlock = b => {  // what the pool's hover line says about block b
  const kv = view.kv, owner = view.owners.get(b);
  if (!kv || b === null) return "";
  const holders = owner === undefined ? "" : ` · held by ${owner}` + (kv.states[b] === "s" ? " and others" : "") +
    ` (${view.requests.get(owner)?.blocks ?? "?"} blocks, outlined)`;
  return `block ${b} · ${STATE_NAMES[kv.states[b]]}${holders}`;
};
view.kvCell = b => {  // the centre of block b on the KV canvas, in CSS pixels
  const canvas = document.getElementById("kv-canvas"), kv = view.kv;
  const g = kvGrid(canvas.clientWidth, Number(canvas.dataset.height), kv.num_blocks);
  return {x: (b % g.columns) * g.size + g.size / 2, y: Math.floor(b / g.columns) * g.size + g.size / 2, size: g.size};
};

// The pool changes a few blocks a step: only blocks whose state or owner changed since the last frame are painted
// again (the whole grid when the canvas or the pool changed shape, or another request is selected), which keeps each
// frame's work small. A block's colour is its state; the selected request's blocks are outlined in its colour.
let kvDrawn = null;
function drawKV() {
  const kv = view.kv;
  if (!kv) return;
  const canvas = document.getElementById("kv-canvas");
  let [ctx, width, height, resized] = sizeCanvas(canvas);
  const g = kvGrid(width, height, kv.num_blocks), styles = getComputedStyle(document.documentElement);
  if (g.height > height) {  // grow, once per pool shape
    canvas.dataset.height = g.height;
    canvas.style.height = `${g.height}px`;
    [ctx, width, height, resized] = sizeCanvas(canvas);
  }
  const fill = {".": styles.getPropertyValue("--free"), "c": styles.getPropertyValue("--cached"),
                "u": styles.getPropertyValue("--used"), "s": styles.getPropertyValue("--shared")};
  const gap = g.size > 4 ? 1 : 0, line = Math.max(2, Math.floor(g.size / 8)), selected = view.selected;
  const whole = resized || !kvDrawn || kvDrawn.size !== g.size || kvDrawn.columns !== g.columns ||
    kvDrawn.owners.length !== kv.num_blocks || kvDrawn.selected !== selected;
  if (whole) ctx.clearRect(0, 0, width, height);
  const owners = new Array(kv.num_blocks);
  for (let b = 0; b < kv.num_blocks; b++) {
    const state = kv.states[b], owner = view.owners.get(b) ?? null;
    owners[b] = owner;
    if (!whole && kvDrawn.states[b] === state && kvDrawn.owners[b] === owner) continue;
    const x = (b % g.columns) * g.size, y = Math.floor(b / g.columns) * g.size;
    ctx.fillStyle = fill[state] || "#888";
    ctx.fillRect(x, y, g.size - gap, g.size - gap);
    if (selected !== null && owner === selected && g.size >= 4) {  // the selected request's: outlined in its colour
      ctx.strokeStyle = view.colourOf(owner); ctx.lineWidth = line;
      ctx.strokeRect(x + line / 2, y + line / 2, g.size - gap - line, g.size - gap - line);
    }
  }
  kvDrawn = {states: kv.states, owners, size: g.size, columns: g.columns, selected};
  const counts = view.kvCounts;
  const summary = `${kv.num_blocks} blocks of ${kv.block_size} tokens: ${counts.u} in use, ${counts.s} shared, ` +
    `${counts.c} cached, ${counts["."]} free`;
  const element = document.getElementById("kv-summary");
  if (element.textContent !== summary) element.textContent = summary;
}

// Each request's row: what the canvas shows, also kept in view.rows ({id, state, note, kinds}) for tests and readers.
function drawTimeline() {
  const canvas = document.getElementById("timeline-canvas");
  const [ctx, width, height] = sizeCanvas(canvas);
  ctx.clearRect(0, 0, width, height);
  const rows = [...view.requests.values()].sort((a, b) => a.arrival - b.arrival).slice(-MAX_ROWS);
  const now = view.lastTime;
  const t0 = rows.length ? Math.min(...rows.map(r => r.arrival)) : now - 1, span = Math.max(now - t0, 1);
  const x = t => LABEL + (width - LABEL - NOTE) * (t - t0) / span;
  const styles = getComputedStyle(document.documentElement), colour = name => styles.getPropertyValue(name);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = colour("--muted");
  const idle = view.counters.steps ? `no requests since this page opened (the engine ran ${view.counters.steps} ` +
    "steps before): send some" : "no requests yet: send some";
  ctx.fillText(rows.length ? `last ${span.toFixed(1)} s` : idle, LABEL, 10);
  view.rows = rows.map((r, i) => {
    const y = 16 + i * ROW, firstStart = r.segments.length ? r.segments[0].t0 : (r.end ?? now);
    if (r.id === view.selected) { ctx.fillStyle = "#eef3fb"; ctx.fillRect(0, y, width, ROW); }
    ctx.fillStyle = view.colourOf(r.id);
    ctx.fillRect(2, y + 3, 8, 8);
    ctx.fillStyle = colour("--ink");
    ctx.fillText(r.id, 14, y + 11);
    ctx.fillStyle = colour("--queued");
    ctx.fillRect(x(r.arrival), y + 6, Math.max(0, x(firstStart) - x(r.arrival)), 3);
    for (const seg of r.segments) {
      ctx.fillStyle = colour(`--${seg.kind}`);
      const [top, tall] = seg.kind === "preempted" ? [y + 1, ROW - 4] : [y + 2, ROW - 6];
      ctx.fillRect(x(seg.t0), top, Math.max(1.5, x(seg.t1) - x(seg.t0)), tall);
    }
    if (r.end !== null) { ctx.fillStyle = colour("--finished"); ctx.fillRect(x(r.end), y, 2, ROW - 2); }
    const note = (r.end !== null
      ? `${r.reason} · ${r.outputTokens} tok` + (r.ttft !== null ? ` · TTFT ${r.ttft.toFixed(0)} ms` : "") +
        (r.itl !== null ? ` · ITL ${r.itl.toFixed(1)} ms` : "")
      : `${r.state} · ${r.outputTokens} tok · ${r.blocks} blocks`) +
      (r.preemptions ? ` · preempted ×${r.preemptions}` : "");
    ctx.fillStyle = colour("--muted");
    ctx.fillText(note, width - NOTE + 6, y + 11);
    return {id: r.id, state: r.state, note, blocks: r.blocks, kinds: [...new Set(r.segments.map(seg => seg.kind))]};
  });
}

// -------------------------------------------------------------------------------- rates and the connection
let previous = {time: performance.now(), steps: 0, updates: 0, tokens: 0};
setInterval(() => {
  const now = performance.now(), dt = (now - previous.time) / 1000;
  const steps = view.counters.steps || 0;
  view.rates = {steps: (steps - previous.steps) / dt, updates: (view.updates - previous.updates) / dt,
                tokens: (tokensSeen - previous.tokens) / dt};
  previous = {time: now, steps, updates: view.updates, tokens: tokensSeen};
  schedule();
}, 1000);

// -------------------------------------------------------------------------------- pointing at a request
// The pool is coloured by state; pointing at a block names its holder and outlines that request's blocks, and
// pointing at a request's row in the timeline outlines its blocks too.
function select(id, text) {
  document.getElementById("kv-hover").textContent = text;
  if (view.selected !== id) { view.selected = id; view.redraw(); }
}
const kvCanvas = document.getElementById("kv-canvas"), timelineCanvas = document.getElementById("timeline-canvas");
kvCanvas.addEventListener("mousemove", event => {
  const b = view.kvBlockAt(event.offsetX, event.offsetY);
  select(b === null ? null : view.owners.get(b) ?? null, b === null ? "" : view.describeBlock(b));
});
timelineCanvas.addEventListener("mousemove", event => {
  const row = (view.rows || [])[Math.floor((event.offsetY - 16) / ROW)];
  select(row ? row.id : null, row ? `${row.id}: ${row.blocks} blocks, outlined` : "");
});
for (const canvas of [kvCanvas, timelineCanvas]) canvas.addEventListener("mouseleave", () => select(null, ""));

function connect() {
  const params = new URLSearchParams(location.search);
  // A server with --api-key wants it on the feed too; EventSource sends no headers, so it goes in the query.
  const events = params.get("events") || "/v1/engine/events", key = params.get("api_key");
  const source = new EventSource(key ? `${events}${events.includes("?") ? "&" : "?"}api_key=${encodeURIComponent(key)}`
                                     : events);
  const status = document.getElementById("connection");
  source.addEventListener("hello", message => {  // (again after a reconnect: the server may be another one)
    const hello = JSON.parse(message.data);
    view.hello = hello; view.steps = []; view.requests = new Map(); view.owners = new Map();
    view.kv = null; view.kvCounts = null; view.selected = null; view.firstState = true; view.counters = {}; view.lastTime = hello.time;
    kvDrawn = null;
    previous = {time: performance.now(), steps: 0, updates: view.updates, tokens: tokensSeen};
    document.getElementById("model").textContent =
      `${hello.model} · ${hello.device} · ${hello.num_blocks} KV blocks · budget ${hello.max_num_batched_tokens} tokens` +
      (hello.speculative ? ` · speculative (${hello.speculative.method}, k = ${hello.speculative.num_speculative_tokens})` : "");
    document.body.classList.toggle("speculative", Boolean(hello.speculative));
    status.dataset.state = "live"; status.textContent = "live";
  });
  source.addEventListener("state", message => {
    applyState(JSON.parse(message.data));
  });
  source.onerror = () => {
    status.dataset.state = "reconnecting"; status.textContent = "reconnecting";
    if (source.readyState === EventSource.CLOSED) {  // an error answer (503): EventSource gives up; we do not
      source.close();
      setTimeout(connect, 2000);
    }
  };
}
connect();
