"""What an export produced, as report.json and report.md: delegation per method (from ExecuTorch's
`get_delegation_info`), preserved ops and whether they reached a delegate intact, deprecation
warnings, size, time and memory per stage."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .pages import export_page, program_size

NOT_COMPUTE = ("getitem",)  # get_delegation_info lists no placeholders or outputs


def delegates(graph_module):
    """The lowered backend modules called by a graph, in order, with those inside its control
    flow's branches (`--experts chosen`'s delegate per expert, behind a torch.cond)."""
    from executorch.exir.graph_module import get_control_flow_submodules

    for node in graph_module.graph.nodes:
        if node.op == "get_attr" and node.name.startswith("lowered_module_"):
            yield getattr(graph_module, node.target)
    for _, branch, _ in get_control_flow_submodules(graph_module):
        yield from delegates(branch)


def delegation(graph_module) -> dict:
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(graph_module)
    by_op = {op: {"delegated": b.delegated, "non_delegated": b.non_delegated}
             for op, b in sorted(info.delegation_by_operator.items())}
    compute = sum(v["non_delegated"] for op, v in by_op.items() if op not in NOT_COMPUTE)
    per_backend: dict[str, dict] = {}
    for lowered in delegates(graph_module):
        entry = per_backend.setdefault(lowered.backend_id, {"subgraphs": 0, "ops": Counter()})
        entry["subgraphs"] += 1
        entry["ops"].update(delegate_ops(lowered))
    return {"subgraphs": info.num_delegated_subgraphs,
            "delegated_nodes": info.num_delegated_nodes,
            "non_delegated_nodes": info.num_non_delegated_nodes,
            "non_delegated_compute_nodes": compute,
            "by_backend": {name: {"subgraphs": e["subgraphs"],
                                  "ops": dict(sorted(e["ops"].items()))}
                           for name, e in per_backend.items()},
            "by_op": by_op}


def op_name(target) -> str:
    """'aten.index_put.default' for aten.index_put_.default and for its edge-dialect op alike."""
    from torch._ops import OpOverload

    inner = getattr(target, "_op", None)  # edge-dialect ops wrap the ATen op they stand for
    name = str(inner if isinstance(inner, OpOverload) and not isinstance(target, OpOverload)
               else target)
    ns, _, rest = name.partition(".")
    base, dot, overload = rest.partition(".")
    return f"{ns}.{base.rstrip('_')}{dot}{overload}" if rest else name


def op_counts(graph_module) -> Counter:
    return Counter(op_name(n.target) for n in graph_module.graph.nodes if n.op == "call_function")


def delegate_ops(lowered) -> Counter:
    """The ops a delegate took: its program's, or those lower.lower_experts recorded of the
    program an expert's delegate no longer keeps."""
    program = lowered.original_module.graph_module
    return program.meta.get("delegated_ops") or op_counts(program)


def op_histogram(programs: dict) -> Counter:
    """Ops of the exported programs, before lowering (which may rewrite them in place)."""
    out = Counter()
    for ep in programs.values():
        out.update(op_counts(ep.graph_module))
    return out


def preserved_report(preserved: list[dict], before: Counter, edge) -> list[dict]:
    """For each op a partitioner asked to keep whole: how often the exported program had it and how
    often it arrived intact inside a delegate."""
    inside = Counter()
    for name in edge.methods:
        for lowered in delegates(edge.exported_program(name).graph_module):
            inside.update(delegate_ops(lowered))
    out = []
    for entry in preserved:
        ops = []
        for op in sorted({op_name(o) for o in entry["ops"]}):
            n_before, n_inside = before.get(op, 0), inside.get(op, 0)
            status = ("absent" if n_before == 0 else
                      "intact" if n_inside >= n_before else "decomposed or not delegated")
            ops.append({"op": op, "in_program": n_before, "in_delegates": n_inside,
                        "status": status})
        out.append({"partitioner": entry["partitioner"], "ops": ops})
    return out


def write(report: dict, folder: Path) -> None:
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "report.md").write_text(markdown(report))
    text = verify_summary(report["verify"]) if "verify" in report else ""
    (folder / "report.html").write_text(export_page(report, text, NOT_COMPUTE), encoding="utf-8")


def _dtypes(state: dict) -> str:
    """" (each buffer kind's dtype)", where the report has them."""
    kinds = state.get("dtypes") or {}
    return f" ({', '.join(f'{k} {v}' for k, v in kinds.items())})" if kinds else ""


def _kv_cache_lines(kv: dict | None) -> list[str]:
    """The KV cache's line, and each backend's state policy with its reason where one was
    settled (Core ML's)."""
    if not kv or not kv.get("layers"):
        return []
    lines = [f"- KV cache: {kv['dtype']}, {kv['bytes'] / 1e6:.2f} MB in {len(kv['layers'])} "
             f"layers, {kv['bytes_per_position'] / 1e3:.1f} kB per position"]
    lines += [f"- {name} state: {e['state_policy']} ({e['reason']})"
              for name, e in kv.items() if isinstance(e, dict) and "state_policy" in e]
    return lines


def _source_lines(q: dict | None) -> list[str]:
    """What each of a quantized file's storage types became (report.json's
    `quantization.from_source`) and what it cost their weights, as a table; nothing for a
    source without types."""
    if not q or not q.get("from_source"):
        return []
    lines = ["", "| the file's type | became | tensors | weight SQNR (dB) |", "|---|---|---|---|"]
    return lines + [f"| {kind} | {to} | {e['tensors']} | "
                    f"{'unchanged' if e['weight_sqnr_db'] is None else e['weight_sqnr_db']} |"
                    for kind, became in q["from_source"].items() for to, e in became.items()]


def markdown(r: dict) -> str:
    lines = [f"# edgellm export: {r['model']['origin']}", "",
             f"- backends: {', '.join(r['backends'])}",
             f"- architecture: {r['model']['model_type']}, {r['model']['n_layers']} layers, "
             f"vocab {r['model']['vocab_size']}, dtype {r['dtype']}",
             f"- program: {program_size(r)}, max_seq_len {r['max_seq_len']}, "
             f"max_context_len {r['max_context_len']}, dynamic shapes {r['dynamic_shapes']}",
             f"- export: {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB",
             *([f"- state between calls (KV caches, ring buffers, conv and recurrent states): "
                f"{r['state']['bytes'] / 1e6:.2f} MB{_dtypes(r['state'])}"]
               if "state" in r else []),
             *_kv_cache_lines(r.get("kv_cache")),
             f"- deprecation warnings while lowering: {r['deprecation_warnings']}", ""]
    lines += ["| method | subgraphs | delegated nodes | non-delegated | non-delegated compute |",
              "|---|---|---|---|---|"]
    for name, m in r["methods"].items():
        d = m["delegation"]
        lines.append(f"| {name} | {d['subgraphs']} | {d['delegated_nodes']} | "
                     f"{d['non_delegated_nodes']} | {d['non_delegated_compute_nodes']} |")
    lines += ["", "| stage | wall s | peak RSS MB |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['wall_s']:.1f} | {s['peak_rss_mb']:.0f} |" for s in r["stages"]]
    lines += _source_lines(r.get("quantization"))
    if "verify" in r:
        lines += ["", "Verification against the checkpoint "
                  f"({'passed' if r['verify']['passed'] else 'FAILED'}):", "", "```",
                  verify_summary(r["verify"]), "```"]
    for entry in r["preserved_ops"]:
        kept = [o for o in entry["ops"] if o["status"] != "absent"]
        if kept:
            lines += ["", f"Ops {entry['partitioner']} asked to keep whole, present in the "
                      "program:"]
            lines += [f"- {o['op']}: {o['status']} ({o['in_delegates']}/{o['in_program']})"
                      for o in kept]
    for name, m in r["methods"].items():
        rest = {op: v["non_delegated"] for op, v in m["delegation"]["by_op"].items()
                if v["non_delegated"] and op not in NOT_COMPUTE}
        if rest:
            lines += ["", f"Not delegated in {name}: " +
                      ", ".join(f"{op} x{n}" for op, n in sorted(rest.items()))]
    return "\n".join(lines) + "\n"


def verify_summary(result: dict) -> str:
    """verify's figures, a line per check, and perplexity."""
    lines = []
    for c in result["checks"]:
        status = "ok" if c["passed"] else "FAILED"
        div = c["first_divergence"] or "none"
        lines.append(f"{c['level']:>14}: {status}  SQNR {c['sqnr_db']:.1f} dB (min "
                     f"{c['min_sqnr_db']:.0f}), top-1 {c['top1']:.3f} (min {c['min_top1']}), "
                     f"max abs {c['max_abs']:.3g}, max rel {c['max_rel']:.3g}, first divergence "
                     f"{div}" + ("" if c.get("perplexity_ratio") is None else
                                 f", perplexity {c['perplexity_ratio']:.3f}x fp32's (max "
                                 f"{c['max_perplexity_ratio']}x)"))
        if c["note"]:
            lines.append(f"{'':>16}{c['note']}")
    if "perplexity" in result:
        ppl = result["perplexity"]
        scores = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in ppl.items()
                           if k not in ("text", "tokens", "top1_vs_fp32", "fp32_argmax"))
        lines.append(f"{'perplexity':>14}: {scores} ({ppl['tokens']} tokens of {ppl['text']}; "
                     f"top-1 agreement with fp32 along the text {ppl['top1_vs_fp32']:.3f})")
    return "\n".join(lines)


def summary(r: dict) -> str:
    d = r["methods"]["forward"]["delegation"]
    return (f"{','.join(r['backends'])}: {program_size(r)}, {d['subgraphs']} "
            f"delegated subgraphs, {d['delegated_nodes']} delegated / "
            f"{d['non_delegated_compute_nodes']} non-delegated compute nodes, "
            f"{r['deprecation_warnings']} deprecation warnings, {r['wall_s']:.1f} s, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB" + verified(r))


def verified(r: dict) -> str:
    if "verify" not in r:
        return ", not verified"
    levels = ", ".join(c["level"] for c in r["verify"]["checks"])
    return f", verified ({levels})" if r["verify"]["passed"] else ", VERIFICATION FAILED"


def load(path) -> dict:
    """A report.json, or the export folder holding one."""
    from ..errors import InputError

    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        return json.loads(p.read_text())
    except OSError as e:
        raise InputError(f"Cannot read report {p}: {e.strerror}. Give an export folder or its "
                         "report.json.") from None
    except json.JSONDecodeError as e:
        raise InputError(f"Report {p} is not valid JSON ({e.msg}, line {e.lineno}).") from None


COLUMNS = ("subgraphs", "delegated_nodes", "non_delegated_nodes")


def compare(a: dict, b: dict, method: str = "forward") -> dict:
    """A results table of two reports (subgraphs, delegated and non-delegated nodes, deprecation
    warnings), and every op whose count changed."""
    from ..errors import InputError

    rows, ops = {}, {}
    for label, r in (("A", a), ("B", b)):
        if method not in r.get("methods", {}):
            raise InputError(f"Report {label} has no method '{method}'; it has "
                             f"{', '.join(r.get('methods', {})) or 'none'}.")
        d = r["methods"][method]["delegation"]
        rows[label] = {**{c: d[c] for c in COLUMNS},
                       "deprecation_warnings": r["deprecation_warnings"]}
        ops[label] = {op: v["delegated"] + v["non_delegated"] for op, v in d["by_op"].items()}
    names = sorted(set(ops["A"]) | set(ops["B"]))
    deltas = {op: [ops["A"].get(op, 0), ops["B"].get(op, 0)] for op in names
              if ops["A"].get(op, 0) != ops["B"].get(op, 0)}
    return {"method": method, "rows": rows, "op_deltas": deltas}


def compare_table(c: dict, labels: tuple[str, str]) -> str:
    head = ("", "subgraphs", "delegated nodes", "non-delegated", "deprecation warnings")
    lines = ["\t".join(head)]
    for key, label in zip(("A", "B"), labels):
        r = c["rows"][key]
        lines.append("\t".join([label] + [str(r[k]) for k in (*COLUMNS, "deprecation_warnings")]))
    lines.append("")
    lines.append(f"ops of {c['method']} whose count changed (A -> B):")
    width = max((len(op) for op in c["op_deltas"]), default=0)
    for op, (x, y) in sorted(c["op_deltas"].items(), key=lambda kv: kv[1][1] - kv[1][0]):
        lines.append(f"  {op:<{width}}  {x:>6} -> {y:<6} ({y - x:+d})")
    if not c["op_deltas"]:
        lines.append("  none")
    return "\n".join(lines)
