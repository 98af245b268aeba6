// graphfl dashboard: polls /api/state and draws each folder (curves, table, graph, benchmark
// results) with hand-written SVG. No dependencies, no network access beyond this server.
"use strict";

const POLL_MS = 1000;
const SVGNS = "http://www.w3.org/2000/svg";
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];
const token = new URLSearchParams(window.location.search).get("token");
let polls = 0;
document.body.dataset.loadId = String(Math.random()).slice(2);

function el(tag, attrs, children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  }
  for (const c of children || []) {
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs, children) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  }
  for (const c of children || []) {
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : v.toPrecision(4);
}

function chart(panel) {
  const W = 360, H = 190, L = 52, R = 10, T = 8, B = 24;
  let xs = [], ys = [];
  for (const s of panel.series) for (const [x, y] of s.points) { xs.push(x); ys.push(y); }
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const py = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  const box = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "chart"});
  box.append(svg("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#ccd2da"}));
  for (const t of [0, 0.5, 1]) {
    const yv = y0 + t * (y1 - y0), xv = x0 + t * (x1 - x0);
    box.append(svg("text", {x: L - 4, y: py(yv) + 3, "text-anchor": "end"}, [fmt(yv)]));
    const xi = xs.every(Number.isInteger) ? Math.round(xv) : xv;
    box.append(svg("text", {x: px(xi), y: H - B + 13, "text-anchor": "middle"}, [fmt(xi)]));
  }
  box.append(svg("text", {x: (L + W - R) / 2, y: H - 1, "text-anchor": "middle"}, ["round"]));
  panel.series.forEach((s, i) => {
    const c = COLOURS[i % COLOURS.length];
    const pts = s.points.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
    const last = s.points.length ? s.points[s.points.length - 1][0] : "";
    box.append(svg("polyline", {points: pts, fill: "none", stroke: c, "stroke-width": 1.6,
                                class: "series", "data-name": s.name, "data-last-x": last}));
    if (s.points.length === 1) {
      box.append(svg("circle", {cx: px(s.points[0][0]), cy: py(s.points[0][1]), r: 2.5, fill: c}));
    }
  });
  const legend = el("div", {class: "legend"},
    panel.series.map((s, i) => el("span", {class: "sw" + (i % 4)}, ["— " + s.name])));
  return el("div", {class: "chart-box"}, [el("h3", {}, [panel.title]), box, legend]);
}

const graphRound = new Map();  // folder path -> index of the round shown; absent = follow the newest
let holding = false;            // a round slider is being dragged: redraws wait until it is let go
let pending = null;

function fmtBytes(b) {
  if (b === null || b === undefined) return "";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let k = 0;
  while (Math.abs(b) >= 1000 && k < units.length - 1) { b /= 1000; k += 1; }
  return (k ? b.toPrecision(3) : String(b)) + " " + units[k];
}

function drawGraph(g, shown) {
  const W = 320, H = 300, cx = W / 2, cy = H / 2 + 6, rad = Math.min(W, H) / 2 - 34;
  const nodes = shown.nodes || g.nodes;
  const edges = shown.edges, notes = shown.edge_note || g.edge_note, states = g.edge_state;
  const bytes = g.edge_bytes;
  const n = nodes.length;
  const pos = new Map();
  nodes.forEach((node, i) => {
    const a = 2 * Math.PI * i / Math.max(n, 1) - Math.PI / 2;
    pos.set(node.id, [cx + rad * Math.cos(a), cy + rad * Math.sin(a)]);
  });
  const wmax = Math.max(1e-12, ...edges.map((e) => Math.abs(e[2])));
  // a direction no peer reported is null: the total counts what was reported, marked "≥"
  const totals = bytes ? bytes.map((b) => (b ? (b[0] ?? 0) + (b[1] ?? 0) : null)) : null;
  const partial = bytes ? bytes.map((b) => !!b && (b[0] === null || b[1] === null)) : null;
  const bmax = totals ? Math.max(1, ...totals.filter((t) => t !== null)) : 1;
  const box = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "graph",
                          "data-nodes": n, "data-edges": edges.length,
                          "data-round": shown.round === undefined ? null : shown.round});
  edges.forEach(([i, j, w], k) => {
    const a = pos.get(i), b = pos.get(j);
    if (!a || !b) return;
    const state = states ? states[k] : null;
    const off = state === "dropped" || state === "unknown";
    const tb = totals ? totals[k] : null;
    // colour: red for dropped / negative edges; by bytes (light to dark orange) when links counted them
    const heat = tb !== null && tb !== undefined ? `hsl(28, 90%, ${Math.round(70 - 45 * tb / bmax)}%)` : null;
    const line = svg("line", {x1: a[0], y1: a[1], x2: b[0], y2: b[1], class: "edge" + (state ? " " + state : ""),
                              stroke: off ? "#d62728" : w < 0 ? "#d62728" : heat || "#5b6b80",
                              "stroke-dasharray": off ? "4 3" : null,
                              "stroke-opacity": off ? 0.7 : heat ? 0.95 : 0.35 + 0.65 * Math.abs(w) / wmax,
                              "stroke-width": off ? 1 : 0.6 + 3.4 * Math.abs(w) / wmax,
                              "data-w": w, "data-bytes": tb});
    const note = notes && notes[k] ? `; ${state ? state + ": " : ""}${notes[k]}` : state ? `; ${state}` : "";
    const sent = bytes && bytes[k]
      ? `; bytes ${i} → ${j}: ${fmtBytes(bytes[k][0]) || "–"}, ${j} → ${i}: ${fmtBytes(bytes[k][1]) || "–"}` : "";
    line.append(svg("title", {}, [`${i} – ${j}: weight ${fmt(w)}${note}${sent}`]));
    box.append(line);
    if (edges.length <= 16) {  // more labels overlap: the weights and bytes stay in each edge's tooltip
      box.append(svg("text", {x: (a[0] + b[0]) / 2, y: (a[1] + b[1]) / 2 - 2, "text-anchor": "middle",
                              class: "edge-label"}, [tb !== null && tb !== undefined ? (partial[k] ? "≥ " : "") + fmtBytes(tb) : fmt(w)]));
    }
  });
  for (const node of nodes) {
    const [x, y] = pos.get(node.id);
    const fill = node.group === null || node.group === undefined || node.group < 0
      ? "#ffffff" : COLOURS[node.group % COLOURS.length];
    const c = svg("circle", {cx: x, cy: y, r: n > 60 ? 4 : 9, fill, stroke: "#1d2430", class: "node",
                             "data-id": node.id, "data-group": node.group});
    c.append(svg("title", {}, [`node ${node.id}` + (node.group !== null && node.group !== undefined
      ? `, cluster ${node.group}` : "")]));
    box.append(c);
    if (n <= 60) box.append(svg("text", {x, y: y + 3.5, "text-anchor": "middle"}, [String(node.id)]));
  }
  const groups = [...new Set(nodes.map((x) => x.group).filter((x) => x !== null && x !== undefined))];
  const cl = groups.length ? ` · ${groups.length} cluster(s), coloured` : "";
  const head = el("h3", {}, [`${shown.title || g.title}: ${n} nodes, ${edges.length} edges${cl}`]);
  return [head, box];
}

function graphView(g, key) {
  const rounds = g.rounds || [];
  const last = rounds.length - 1;
  const saved = graphRound.get(key);
  let cur = saved === undefined || saved > last ? last : saved;
  const [head0, box0] = drawGraph(g, rounds.length ? rounds[cur] : g);
  const wrap = el("div", {class: "graph-box"}, [head0, box0]);
  if (rounds.length < 2) {
    if (g.cap) wrap.append(el("div", {class: "graph-cap"}, [g.cap]));
    return wrap;
  }
  const slider = el("input", {type: "range", min: 0, max: last, step: 1, value: cur, class: "round-slider",
                              "data-slider-for": key, "aria-label": "round of the learned graph"});
  const label = el("span", {class: "round-label"}, []);
  const show = (k) => {
    cur = Math.min(last, Math.max(0, k));
    if (cur === last) graphRound.delete(key); else graphRound.set(key, cur);  // the newest: follow it
    const [head, box] = drawGraph(g, rounds[cur]);
    wrap.replaceChild(head, wrap.children[0]);
    wrap.replaceChild(box, wrap.children[1]);
    slider.value = String(cur);
    label.dataset.round = String(rounds[cur].round);
    label.textContent = cur === last ? `round ${rounds[cur].round}, following the newest`
      : `round ${rounds[cur].round} (newest: ${rounds[last].round})`;
  };
  slider.addEventListener("input", () => show(Number(slider.value)));
  slider.addEventListener("pointerdown", () => { holding = true; });
  const button = (cls, title, text, to) => {
    const b = el("button", {type: "button", class: cls, title}, [text]);
    b.addEventListener("click", () => show(to()));
    return b;
  };
  wrap.append(el("div", {class: "round-bar"}, [
    button("round-back", "previous round", "◀", () => cur - 1), slider,
    button("round-next", "next round", "▶", () => cur + 1),
    button("round-newest", "follow the newest round", "newest", () => last), label]));
  wrap.append(el("div", {class: "graph-cap"}, [g.cap || `all ${rounds.length} rounds that logged a graph`]));
  show(cur);
  return wrap;
}

function letGo() {
  if (!holding) return;
  holding = false;
  if (pending) { const p = pending; pending = null; render(p); }
}
window.addEventListener("pointerup", letGo);
window.addEventListener("pointercancel", letGo);
window.addEventListener("blur", letGo);

function table(t) {
  const head = el("tr", {}, t.columns.map((c) => el("th", {}, [c.replace(/_/g, " ")])));
  const rows = t.rows.map((r) => el("tr", {class: r.status === "failed" ? "failed" : "ok", "data-id": r.id},
    t.columns.map((c) => {
      let v = r[c];
      if (c === "last_seen_s" && typeof v === "number") v = v.toFixed(1) + " s ago";
      return el("td", {class: typeof v === "number" ? "num" : "text", "data-col": c}, [fmt(v)]);
    })));
  const label = t.kind === "peer" ? "peers" : "clients";
  return el("div", {class: "table-box"}, [el("h3", {}, [`${label} (${t.rows.length})`]),
    el("table", {class: "grid " + label}, [head, ...rows])]);
}

function benchTable(cls, rows, lead, columns, cellOf) {
  const cols = [...lead, ...columns];
  const errors = rows.some((r) => r.error);  // failed or skipped rows: red, with their error text
  const head = el("tr", {}, [...cols, ...(errors ? ["error"] : [])].map((c) => el("th", {}, [c.replace(/_/g, " ")])));
  const body = rows.map((r) => {
    const tr = el("tr", {class: cls + (r.failed || r.error ? " failed" : "")},
      cols.map((c) => el("td", {class: lead.includes(c) ? "text" : "num", "data-col": c}, [cellOf(r, c)])));
    if (errors) tr.append(el("td", {class: "text", "data-col": "error"}, [r.error || ""]));
    return tr;
  });
  return el("table", {class: "grid bench " + cls}, [head, ...body]);
}

function benchView(docs) {
  // the comparison view of one benchmark result: methods (mean ± sd, seeds), paired differences, verdicts
  return docs.map((d) => {
    const pointed = d.rows.some((r) => r.point);
    const lead = [...(pointed ? ["point"] : []), "method", "seeds"];
    const cellOf = (r, c) => (c === "point" ? r.point : c === "method" ? r.method
      : c === "seeds" ? fmt(r.seeds) : (r.cells[c] || ""));
    const parts = [el("h3", {}, [`${d.name} (${d.file}): ${d.methods} methods, ${d.rows.length} rows`]),
                   benchTable("method", d.rows, lead, d.columns, cellOf)];
    if (d.paired) {
      const plead = [...(d.paired.rows.some((r) => r.point) ? ["point"] : []), "pair"];
      const noted = d.paired.rows.some((r) => r.note);
      parts.push(el("h3", {}, ["paired differences (first − second, per seed)"]),
        benchTable("paired", d.paired.rows, plead, [...d.paired.columns, ...(noted ? ["note"] : [])],
                   (r, c) => (c === "point" ? r.point : c === "pair" ? r.pair
                     : c === "note" ? r.note : (r.cells[c] || ""))));
    }
    if (d.verdicts.length) {
      parts.push(el("ul", {class: "verdicts"}, d.verdicts.map((v) => el("li", {class: "verdict"}, [
        ...(v.status ? [el("span", {class: "verdict-status " + v.status.replace(/ /g, "-"),
                                    "data-status": v.status}, [v.status])] : []),
        (v.name ? `${v.name}: ` : "") + v.text,
        ...(v.evidence.length ? [el("ul", {class: "evidence"}, v.evidence.map((e) => el("li", {}, [e])))] : [])]))));
    }
    if (d.caps.length) parts.push(el("div", {class: "graph-cap bench-cap"}, [d.caps.join("; ")]));
    return el("div", {class: "table-box"}, parts);
  });
}

function folderView(f, i) {
  const status = f.status || f.kind;
  const head = el("h2", {}, [el("span", {class: "title"}, [f.title]),
    el("span", {class: "badge " + status, "data-status": status}, [status]),
    el("span", {class: "last-round", "data-round": f.last_round === null ? "" : f.last_round},
       [f.last_round === null ? "" : `round ${f.last_round}` + (f.rounds ? ` / ${f.rounds}` : "")]),
    el("span", {class: "path"}, [f.path])]);
  const parts = [head];
  if (f.error) parts.push(el("div", {class: "error-box"}, ["error: " + f.error]));
  if (f.messages.length) parts.push(el("ul", {class: "messages"}, f.messages.map((m) => el("li", {}, [m]))));
  if (f.facts) {
    parts.push(el("div", {class: "facts"}, [Object.entries(f.facts).map(([k, v]) => `${k}: ${v}`).join(" · ")]));
  }
  const row = el("div", {class: "row"}, f.panels.map(chart));
  if (f.graph) row.append(graphView(f.graph, f.path));
  parts.push(row);
  if (f.table) parts.push(table(f.table));
  if (f.bench) parts.push(...benchView(f.bench));
  return el("section", {class: "folder kind-" + f.kind, id: "folder-" + i}, parts);
}

function render(state) {
  if (holding) { pending = state; return; }
  const active = document.activeElement;
  const focused = active && active.dataset ? active.dataset.sliderFor : undefined;
  const main = document.getElementById("folders");
  main.replaceChildren(...state.folders.map(folderView));
  if (focused !== undefined) {  // keep the keyboard on the slider across redraws
    const again = [...main.querySelectorAll("input.round-slider")].find((x) => x.dataset.sliderFor === focused);
    if (again) again.focus();
  }
}

async function poll() {
  const conn = document.getElementById("conn");
  try {
    const url = "api/state" + (token ? "?token=" + encodeURIComponent(token) : "");
    const resp = await fetch(url, {cache: "no-store"});
    if (!resp.ok) throw new Error(`HTTP ${resp.status}: ${(await resp.text()).slice(0, 200)}`);
    render(await resp.json());
    polls += 1;
    document.body.dataset.polls = String(polls);
    conn.textContent = "live";
    conn.className = "conn ok";
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    conn.textContent = "dashboard server unreachable (" + err.message + "); showing the last data";
    conn.className = "conn down";
  } finally {
    window.setTimeout(poll, POLL_MS);
  }
}

poll();
