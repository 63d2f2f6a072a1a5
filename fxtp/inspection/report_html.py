"""``graph.html``: a report as one self-contained page (inline CSS and JavaScript, no network).

The page embeds the report's JSON; its script builds everything from it: the summary on
top (collectives by kind forward and backward, bytes per step, parameter memory, the
per-layer rollup, fallbacks, symbolic dims), then the graph's nodes grouped by module FQN
in collapsible sections, each node colored by placement and collectives highlighted.
When it has run, ``<body data-rendered="true">``.
"""
from __future__ import annotations

import json

from .report import Report

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>fxtp report</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #1d2330; }
h1 { font-size: 20px; margin: 0 0 8px; } h2 { font-size: 16px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 4px 0 10px; }
th, td { padding: 2px 8px; border-bottom: 1px solid #e3e6ea; text-align: left;
         white-space: nowrap; }
th { background: #f2f4f7; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; }
.card { border: 1px solid #d5dae1; border-radius: 6px; padding: 8px 12px; min-width: 180px; }
.card b { display: block; font-size: 18px; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 6px; border-radius: 3px; }
.p-R { background: #e4ecf7; } .p-S { background: #d6f0d6; } .p-St { background: #cdeeea; }
.p-P { background: #fde3c4; } .p-none { background: #ffffff; }
tr.collective td { background: #ffd9d9; font-weight: 600; }
tr.collective td:first-child { border-left: 4px solid #d62728; }
tr.fallback td { background: #fff3a8; }
details.module { margin: 2px 0 2px 14px; }
details.module > summary { cursor: pointer; padding: 2px 0; }
summary .fqn { font-family: ui-monospace, monospace; font-weight: 600; }
summary .badge { background: #d62728; color: #fff; border-radius: 8px; padding: 0 7px;
                 margin-left: 8px; font-size: 11px; }
summary .count { color: #687385; margin-left: 8px; }
td.mono, .mono { font-family: ui-monospace, monospace; }
#fallbacks li { background: #fff3a8; margin: 2px 0; padding: 2px 6px; }
</style>
</head>
<body>
<script type="application/json" id="fxtp-report">__REPORT__</script>
<div id="summary"></div>
<h2>Graph by module</h2>
<div class="legend">placement:
 <span class="p-R">R replicated</span><span class="p-S">S(d) sharded</span>
 <span class="p-St">S(d)/k strided</span><span class="p-P">P partial</span>
 <span class="p-none">- no tensor</span>
 <span style="background:#ffd9d9;border-left:4px solid #d62728">collective</span>
 <span style="background:#fff3a8">fallback</span>
 <button id="expand">expand all</button> <button id="collapse">collapse all</button>
</div>
<div id="graph"></div>
<script>
"use strict";
const report = JSON.parse(document.getElementById("fxtp-report").textContent);
const S = report.summary;
const ABBR = {all_reduce: "AR", all_gather: "AG", reduce_scatter: "RS"};

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c));
  return e;
}
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, x = n;
  while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
  return i === 0 ? n + " B" : x.toFixed(1) + " " + units[i];
}
function shape(s) {
  return s === null ? "-" : "(" + s.join(", ") + (s.length === 1 ? ",)" : ")");
}
function comms(list) {
  return list.map(c => (ABBR[c.kind] || c.kind) + " " + bytes(c.bytes)).join(", ") || "-";
}
function totals(t) {
  return Object.keys(t.counts).sort().map(k => t.counts[k] + " " + (ABBR[k] || k))
    .join(", ") || "-";
}
function sum(obj) { return Object.values(obj).reduce((a, b) => a + b, 0); }
function placementClass(p) {
  if (p.startsWith("(")) p = p.slice(1).split(", ")[0];  // multi-output: its first
  if (p.startsWith("S(")) return p.includes("/") ? "p-St" : "p-S";
  return {R: "p-R", P: "p-P"}[p] || "p-none";
}
function table(id, headers, rows, numeric) {
  const t = el("table", {id: id});
  t.append(el("tr", {}, ...headers.map(h => el("th", {}, h))));
  for (const r of rows) {
    t.append(el("tr", {}, ...r.map((c, i) =>
      el("td", numeric.includes(i) ? {class: "num"} : {}, c))));
  }
  return t;
}

function renderSummary() {
  const root = document.getElementById("summary");
  const nColl = report.nodes.filter(n => n.collective).length;
  root.append(el("h1", {}, "fxtp report: " + report.nodes.length + " nodes, world size " +
                 S.world_size));
  const share = S.param_bytes_unsharded ? S.param_bytes / S.param_bytes_unsharded : 1;
  root.append(el("div", {class: "cards"},
    el("div", {class: "card", id: "bytes-per-step"}, "bytes per rank per step",
       el("b", {}, bytes(S.bytes_per_step))),
    el("div", {class: "card", id: "param-memory"}, "parameters per rank",
       el("b", {}, bytes(S.param_bytes) + " / " + bytes(S.param_bytes_unsharded)),
       (100 * share).toFixed(1) + "% of unsharded"),
    el("div", {class: "card"}, "collective nodes in the graph", el("b", {}, nColl)),
    el("div", {class: "card", id: "fallback-count"}, "fallbacks",
       el("b", {}, S.fallbacks.length))));
  root.append(el("h2", {}, "Collectives per step (bytes per rank)"));
  const kinds = [...new Set([...Object.keys(S.forward.counts),
                             ...Object.keys(S.backward.counts)])].sort();
  root.append(table("collectives",
    ["collective", "forward", "fwd bytes", "backward", "bwd bytes"],
    kinds.map(k => [k, S.forward.counts[k] || 0, bytes(S.forward.bytes[k] || 0),
                    S.backward.counts[k] || 0, bytes(S.backward.bytes[k] || 0)]),
    [1, 2, 3, 4]));
  root.append(el("h2", {}, "Per layer"));
  root.append(table("layers",
    ["layer", "forward", "fwd bytes", "backward", "bwd bytes", "params/rank", "unsharded"],
    S.layers.map(l => [l.layer || "<root>", totals(l.forward), bytes(sum(l.forward.bytes)),
                       totals(l.backward), bytes(sum(l.backward.bytes)),
                       bytes(l.param_bytes), bytes(l.param_bytes_unsharded)]),
    [2, 4, 5, 6]));
  root.append(el("h2", {}, "Fallbacks (ops gathered to Replicate)"));
  const list = el("ul", {id: "fallbacks"});
  for (const f of S.fallbacks) {
    list.append(el("li", {}, el("span", {class: "mono"}, f.node + " (" + f.op + ")"),
                   " in '" + (f.module || "<root>") + "': " + f.message));
  }
  if (!S.fallbacks.length) list.append(el("li", {style: "background:none"}, "none"));
  root.append(list);
  if (S.held_whole.length) {
    root.append(el("h2", {}, "Held whole on every rank though the plan shards them"));
    const whole = el("ul", {id: "held-whole"});
    for (const h of S.held_whole) {
      whole.append(el("li", {}, el("span", {class: "mono"}, h.param),
                      " (+" + bytes(h.extra_bytes) + "): " + h.message));
    }
    root.append(whole);
  }
  const dims = Object.entries(S.symbolic_dims);
  if (dims.length) {
    root.append(el("p", {id: "symbolic"}, "Symbolic dims (sizes and bytes use these " +
                   "hints): " + dims.map(([k, v]) => k + "=" + v).join(", ")));
  }
}

function moduleTree() {
  // groups ordered by where their computation starts (parameters are read up front)
  const root = {fqn: "", nodes: [], children: new Map()};
  const groupOf = n => {
    let group = root;
    const parts = n.module ? n.module.split(".") : [];
    for (let i = 1; i <= parts.length; i++) {
      const fqn = parts.slice(0, i).join(".");
      if (!group.children.has(fqn)) {
        group.children.set(fqn, {fqn: fqn, nodes: [], children: new Map()});
      }
      group = group.children.get(fqn);
    }
    return group;
  };
  report.nodes.filter(n => !["placeholder", "get_attr"].includes(n.op)).forEach(groupOf);
  report.nodes.forEach(n => groupOf(n).nodes.push(n));
  return root;
}
function allNodes(group) {
  return [...group.nodes, ...[...group.children.values()].flatMap(allNodes)];
}
function nodeRow(n) {
  const cls = ["node", placementClass(n.placement)];
  if (n.collective) cls.push("collective");
  if (n.fallback) cls.push("fallback");
  const row = el("tr", {class: cls.join(" "), "data-name": n.name},
    el("td", {class: "mono"}, n.name), el("td", {class: "mono"}, n.op),
    el("td", {}, shape(n.global_shape)), el("td", {}, shape(n.local_shape)),
    el("td", {class: placementClass(n.placement)}, n.placement),
    el("td", {}, n.collective || ""), el("td", {}, n.collective ? comms(n.forward) : ""),
    el("td", {}, n.collective ? comms(n.backward) : ""));
  if (n.fallback) row.title = n.fallback;
  return row;
}
function renderGroup(group, depth) {
  const inside = allNodes(group);
  const coll = inside.filter(n => n.collective);
  const head = el("summary", {}, el("span", {class: "fqn"}, group.fqn || "<root>"),
                  el("span", {class: "count"}, inside.length + " nodes"));
  if (coll.length) {
    head.append(el("span", {class: "badge"}, coll.length + " collective" +
                    (coll.length > 1 ? "s" : "")));
  }
  const box = el("details", {class: "module", "data-fqn": group.fqn}, head);
  if (depth < 1) box.open = true;
  if (group.nodes.length) {
    const t = el("table", {class: "nodes"}, el("tr", {}, ...["node", "op", "global shape",
      "local shape", "placement", "collective", "forward", "backward"].map(
        h => el("th", {}, h))));
    group.nodes.forEach(n => t.append(nodeRow(n)));
    box.append(t);
  }
  for (const child of group.children.values()) box.append(renderGroup(child, depth + 1));
  return box;
}

renderSummary();
document.getElementById("graph").append(renderGroup(moduleTree(), 0));
for (const [id, open] of [["expand", true], ["collapse", false]]) {
  document.getElementById(id).onclick = () =>
    document.querySelectorAll("details.module").forEach(d => { d.open = open; });
}
document.body.dataset.rendered = "true";
</script>
</body>
</html>
"""


def render_html(report: Report) -> str:
    """The page for ``report``; its JSON is embedded with every ``<`` escaped, so no
    string in it can close the script element."""
    data = json.dumps(report.to_dict()).replace("<", "\\u003c")
    return _PAGE.replace("__REPORT__", data)
