"""Self-contained HTML pages: an export's `report.html` and a sweep's `index.html`.

Charts are Plotly's (its JavaScript read from the installed `plotly` package and inlined, so a page
opens offline, alone); tables sort on a header click. Figures are built here as Plotly's JSON
(traces and layouts), not through plotly's Python API, so writing a page imports nothing heavy.
"""

from __future__ import annotations

import functools
import html
import json

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1300px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f2f2f2}th.sort{cursor:pointer;user-select:none}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}.bad{color:#b00020}
.charts{display:flex;flex-wrap:wrap;gap:12px}.chart{width:620px;height:420px}
"""
# Click a header to sort by it (numbers as numbers, empty cells last); again to reverse.
SORT_JS = """
document.querySelectorAll('table.sortable').forEach(function(table){
  table.querySelectorAll('th').forEach(function(th, col){
    th.classList.add('sort');
    th.addEventListener('click', function(){
      var up = th.getAttribute('aria-sort') !== 'ascending';
      table.querySelectorAll('th').forEach(function(h){h.removeAttribute('aria-sort');});
      th.setAttribute('aria-sort', up ? 'ascending' : 'descending');
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      function key(r){var c = r.cells[col]; return c.dataset.value !== undefined ?
                      c.dataset.value : c.textContent;}
      rows.sort(function(a, b){
        var x = key(a), y = key(b);
        if (x === '' || y === '') return (x === '') - (y === '');
        var nx = Number(x), ny = Number(y);
        var d = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
        return up ? d : -d;
      });
      rows.forEach(function(r){body.appendChild(r);});
    });
  });
});
"""


@functools.lru_cache(maxsize=1)
def plotly_js() -> str:
    """Plotly's bundle as the installed `plotly` package ships it."""
    from importlib.resources import files

    try:
        return (files("plotly") / "package_data" / "plotly.min.js").read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        from ..errors import InputError

        raise InputError(f"edgellm's HTML reports inline Plotly's JavaScript from the `plotly` "
                         f"package, which is missing ({e}): pip install plotly") from e


def page(title: str, body: list[str], charts: dict[str, dict]) -> str:
    """A page: `body` HTML fragments, then each chart (div id -> {data, layout}) drawn by Plotly."""
    draw = "".join(f"Plotly.newPlot({json.dumps(div)}, {json.dumps(fig['data'])}, "
                   f"{json.dumps(fig['layout'])}, {{responsive: true, displaylogo: false}});\n"
                   for div, fig in charts.items())
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{STYLE}</style>\n<script>{plotly_js()}</script></head>\n<body>\n"
            + "\n".join(body) + f"\n<script>\n{draw}{SORT_JS}</script>\n</body></html>\n")


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def chart_div(div: str) -> str:
    return f'<div class="chart" id="{esc(div)}"></div>'


def table(columns: list[str], rows: list[list], *, sortable: bool = True, ident: str = "") -> str:
    """An HTML table; a cell is a value, or (text, value) to sort by value, or (html, value, True)
    for markup. Numbers are right-aligned."""
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    attributes = (f' id="{esc(ident)}"' if ident else "") + (' class="sortable"' if sortable
                                                             else "")
    out = [f"<table{attributes}><thead><tr>{head}</tr></thead><tbody>"]
    for row in rows:
        cells = []
        for cell in row:
            raw = isinstance(cell, tuple) and len(cell) == 3
            text, value = (cell[0], cell[1]) if isinstance(cell, tuple) else (cell, cell)
            text = "" if text is None else (text if raw else esc(fmt(text)))
            num = isinstance(value, (int, float)) and not isinstance(value, bool)
            data = f' data-value="{esc(value)}"' if num else (' data-value=""' if value is None
                                                              else "")
            cells.append(f"<td{' class=num' if num else ''}{data}>{text}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</tbody></table>"


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def bars(names: list[str], series: dict[str, list], title: str, *, horizontal: bool = False,
         stacked: bool = True, yaxis: str = "") -> dict:
    """A bar chart: one trace per series, over `names`."""
    data = [{"type": "bar", "name": label, "orientation": "h" if horizontal else "v",
             **({"y": names, "x": values} if horizontal else {"x": names, "y": values})}
            for label, values in series.items()]
    layout = {"title": {"text": title}, "barmode": "stack" if stacked else "group",
              "margin": {"l": 170 if horizontal else 60, "r": 20, "t": 50, "b": 60},
              "legend": {"orientation": "h"}}
    if horizontal:  # the legend above the plot, clear of the x axis' title
        layout["legend"].update(y=1.02, yanchor="bottom", x=1, xanchor="right")
        layout["yaxis"] = {"automargin": True, "autorange": "reversed"}
        layout["xaxis"] = {"title": {"text": yaxis}}
    else:
        layout["yaxis"] = {"title": {"text": yaxis}}
    return {"data": data, "layout": layout}


# --- an export's report.html ---------------------------------------------------------------------

def export_page(r: dict, verify_text: str = "", hidden_ops=("getitem",)) -> str:
    """report.html: the report's summary, delegation per method, op histograms (but
    `hidden_ops`), verification figures (and `verify_text`, their summary) and stage times."""
    methods = r["methods"]
    delegation = {name: m["delegation"] for name, m in methods.items()}
    charts = {"delegation": bars(list(delegation), {
        "delegated nodes": [d["delegated_nodes"] for d in delegation.values()],
        "non-delegated compute nodes": [d["non_delegated_compute_nodes"]
                                        for d in delegation.values()],
        "other non-delegated nodes": [d["non_delegated_nodes"] - d["non_delegated_compute_nodes"]
                                      for d in delegation.values()]},
        "Delegation per method", yaxis="nodes")}
    for name, d in delegation.items():
        ops = sorted((op for op in d["by_op"] if op not in hidden_ops),
                     key=lambda op: -sum(d["by_op"][op].values()))
        charts[f"ops-{name}"] = bars(ops, {
            "delegated": [d["by_op"][op]["delegated"] for op in ops],
            "not delegated": [d["by_op"][op]["non_delegated"] for op in ops]},
            f"Ops in {name}", horizontal=True, yaxis="nodes")
        charts[f"ops-{name}"]["layout"]["height"] = max(320, 60 + 18 * len(ops))
    stages = r["stages"]
    charts["stages"] = bars([s["name"] for s in stages],
                            {"wall s": [s["wall_s"] for s in stages]}, "Stages", yaxis="s")
    charts["stages"]["data"].append({
        "type": "scatter", "mode": "lines+markers", "name": "peak RSS MB", "yaxis": "y2",
        "x": [s["name"] for s in stages], "y": [s["peak_rss_mb"] for s in stages]})
    charts["stages"]["layout"]["yaxis2"] = {"title": {"text": "peak RSS MB"}, "overlaying": "y",
                                            "side": "right", "rangemode": "tozero"}
    charts["stages"]["layout"]["margin"]["r"] = 70
    body = [f"<h1>edgellm export: {esc(r['model']['origin'])}</h1>", summary_list(r),
            '<p><a href="report.md">report.md</a> · <a href="report.json">report.json</a></p>',
            "<h2>Delegation</h2>", '<div class="charts">', chart_div("delegation"),
            *[chart_div(f"ops-{name}") for name in delegation], "</div>",
            table(["method", "subgraphs", "delegated nodes", "non-delegated",
                   "non-delegated compute"],
                  [[name, d["subgraphs"], d["delegated_nodes"], d["non_delegated_nodes"],
                    d["non_delegated_compute_nodes"]] for name, d in delegation.items()])]
    body += verification_section(r.get("verify"), verify_text)
    body += ["<h2>Stages</h2>", '<div class="charts">', chart_div("stages"), "</div>",
             table(["stage", "wall s", "peak RSS MB"],
                   [[s["name"], s["wall_s"], s["peak_rss_mb"]] for s in stages])]
    return page(f"edgellm export: {r['model']['origin']}", body, charts)


def program_size(r: dict) -> str:
    """'93.3 MB', or with its weights in a data file, '93.3 MB (model.pte 0.4 MB, foundation.ptd
    92.8 MB)': pte_bytes counts every file the program needs (file_bytes)."""
    parts = r.get("file_bytes") or {}
    split = f" ({', '.join(f'{n} {b / 1e6:.1f} MB' for n, b in parts.items())})"
    return f"{r['pte_bytes'] / 1e6:.1f} MB" + (split if len(parts) > 1 else "")


def summary_list(r: dict) -> str:
    model = r["model"]
    items = [f"backends: {', '.join(r['backends'])}",
             f"architecture: {model['model_type']}, {model['n_layers']} layers, vocab "
             f"{model['vocab_size']}, dtype {r['dtype']}",
             f"program: {program_size(r)}, max_seq_len {r['max_seq_len']}, "
             f"max_context_len {r['max_context_len']}",
             f"export: {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB"]
    quant = r.get("quantization")
    if quant:
        group = quant.get("group_size")
        items.append(f"quantization: {quant.get('recipe') or 'float linears'}"
                     + (f", group {group}" if quant.get("recipe") and group is not None else "")
                     + (f", embeddings {quant['embeddings']}" if quant.get("embeddings") else ""))
    if "state" in r:
        items.append(f"state between calls: {r['state']['bytes'] / 1e6:.2f} MB")
    return "<ul>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>"


def verification_section(v: dict | None, text: str) -> list[str]:
    if not v:
        return ["<h2>Verification</h2>", "<p>Not verified (exported with --no-verify).</p>"]
    rows = [[c["level"], ("passed" if c["passed"] else "FAILED", int(c["passed"])), c["sqnr_db"],
             c["min_sqnr_db"], c["top1"], c["min_top1"], c["max_abs"], c["max_rel"],
             c["first_divergence"] or "none"] for c in v["checks"]]
    status = "passed" if v["passed"] else '<span class="bad">FAILED</span>'
    return [f"<h2>Verification: {status}</h2>",
            table(["check", "result", "SQNR dB", "min SQNR dB", "top-1", "min top-1", "max abs",
                   "max rel", "first divergence"], rows),
            f"<pre>{esc(text)}</pre>"]


# --- a sweep's index.html ------------------------------------------------------------------------

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")  # a backend's points and front
# (row field, axis title, larger is better)
ACCURACY = (("accuracy.text_top1", "top-1 agreement with fp32 along the text", True),
            ("accuracy.perplexity", "perplexity of the text", False),
            ("accuracy.sqnr_db", "SQNR dB against fp32", True),
            ("accuracy.top1", "top-1 agreement with fp32 (verify's check)", True))
SPEED = (("speed.decode_tok_s", "decode tok/s", True),
         ("speed.prefill_tok_s", "prefill tok/s (64 tokens)", True))


def value(row: dict, dotted: str):
    for part in dotted.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def pareto(points: list[tuple[float, float]], larger_better: bool) -> list[int]:
    """Indices of the points no other point beats: as small and at least as good, or smaller
    and as good (x is size, smaller is better); in order of size."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]
                                                      if larger_better else points[i][1]))
    front, best = [], None
    for i in order:
        y = points[i][1] if larger_better else -points[i][1]
        if best is None or y > best:
            front.append(i)
            best = y
    return front


def scatter(rows: list[dict], measures, title: str) -> dict:
    """Size (x) against each measure (y), a trace per backend and its Pareto front, one measure
    shown at a time (buttons switch)."""
    backends = sorted({r["backend"] for r in rows})
    color = {b: COLORS[i % len(COLORS)] for i, b in enumerate(backends)}
    data, menus = [], []
    for k, (key, label, larger) in enumerate(measures):
        first = len(data)
        for backend in backends:
            mine = [r for r in rows if r["backend"] == backend and value(r, key) is not None]
            xy = [(r["pte_bytes"] / 1e6, value(r, key)) for r in mine]
            data.append({"type": "scatter", "mode": "markers+text", "name": backend,
                         "meta": "exports", "visible": k == 0, "legendgroup": backend,
                         "x": [p[0] for p in xy], "y": [p[1] for p in xy],
                         "text": [r["recipe"] for r in mine], "textposition": "top center",
                         "customdata": [r["name"] for r in mine],
                         "marker": {"size": 10, "color": color[backend], "symbol": [
                             "circle" if r["status"] == "ok" else "x" for r in mine]},
                         "hovertemplate": "%{customdata}<br>%{x:.1f} MB<br>"
                                          f"{label} %{{y:.4g}}<extra></extra>"})
            front = pareto(xy, larger)
            data.append({"type": "scatter", "mode": "lines", "name": f"{backend} Pareto front",
                         "meta": "pareto", "visible": k == 0, "legendgroup": backend,
                         "line": {"dash": "dot", "shape": "hv", "color": color[backend]},
                         "x": [xy[i][0] for i in front], "y": [xy[i][1] for i in front],
                         "hoverinfo": "skip"})
        menus.append({"label": label, "method": "update", "args": [
            {"visible": [first <= i < first + 2 * len(backends) for i in range(
                len(measures) * 2 * len(backends))]}, {"yaxis.title.text": label}]})
    layout = {"title": {"text": title, "x": 0.02, "xanchor": "left"},
              "xaxis": {"title": {"text": ".pte MB"}, "rangemode": "tozero"},
              "yaxis": {"title": {"text": measures[0][1]}}, "legend": {"orientation": "h"},
              "margin": {"l": 60, "r": 20, "t": 90, "b": 60},
              "updatemenus": [{"buttons": menus, "direction": "down", "x": 1, "xanchor": "right",
                               "y": 1.2, "yanchor": "top"}] if len(measures) > 1 else []}
    return {"data": data, "layout": layout}


def sweep_page(rows: list[dict], title: str) -> str:
    """index.html: size against accuracy and speed against size per backend, each with its
    Pareto front, and every row in a sortable table linking to its export's report.html."""
    made = [r for r in rows if r.get("pte_bytes")]
    engine = [r for r in rows if r["backend"] == "llama.cpp"]  # a GGUF run beside (--beside)
    rows = [r for r in rows if r not in engine]
    charts = {"accuracy": scatter(made, ACCURACY, "Size against accuracy"),
              "speed": scatter(made, SPEED, "Speed against size (this machine)")}
    failed = sum(r["status"] != "ok" for r in rows)
    columns = ["export", "backend", "recipe", "status", ".pte MB", "SQNR dB", "top-1",
               "perplexity", "text top-1", "prefill tok/s", "decode tok/s", "export s",
               "peak RSS MB", "estimated peak MB", "error"]
    table_rows = []
    for r in rows + engine:
        link = (f'<a href="{esc(r["name"])}/report.html">{esc(r["name"])}</a>', r["name"], True) \
            if r.get("pte_bytes") and r not in engine else r["name"]
        mb = round(r["pte_bytes"] / 1e6, 2) if r.get("pte_bytes") else None
        speed_error = value(r, "speed.bench_error")
        table_rows.append([link, r["backend"], r["recipe"], r["status"], mb] + [
            value(r, k) for k in ("accuracy.sqnr_db", "accuracy.top1", "accuracy.perplexity",
                                  "accuracy.text_top1", "speed.prefill_tok_s",
                                  "speed.decode_tok_s", "export_s", "peak_rss_mb",
                                  "estimated_peak_mb")]
            + [r.get("error") or (f"bench: {speed_error}" if speed_error else None)])
    body = [f"<h1>{esc(title)}</h1>",
            f"<p>{len(rows)} exports, {len(rows) - failed} ok, {failed} not ok. Accuracy is "
            "against transformers in fp32 (the recipe's own check, else the program's, else the "
            "exported graph's where the backend does not run here); speed is `edgellm bench` on "
            "the machine that ran the export (backends that run there). Crosses: exports that "
            "failed verification." + (" The llama.cpp row is the file given beside the "
                                      "sweep, run by llama.cpp along the same text: its size "
                                      "is the file's." if engine else "")
            + ' <a href="results.json">results.json</a> · '
            '<a href="results.csv">results.csv</a></p>',
            '<div class="charts">', chart_div("accuracy"), chart_div("speed"), "</div>",
            "<h2>Exports</h2><p>Click a header to sort.</p>",
            table(columns, table_rows, ident="exports")]
    return page(title, body, charts)
