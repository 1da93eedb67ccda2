"""Helpers for bench/export_vs_anchor.sh: one JSON line per edgellm export, and the side-by-side
table against the reference's anchor.jsonl (last line: one JSON object)."""

import json
import re
import sys
from pathlib import Path


def wall_and_rss(log: str):
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", log)
    wall = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3)) if m else None
    r = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
    return wall, (int(r.group(1)) // 1024 if r else None)


def decode_speed(pte: Path, prefill=64, steps=32):
    """speed_vs_anchor's measure: a `prefill`-token prefill (the best of three calls) and the
    median of `steps` decode calls."""
    import torch
    from speed_vs_anchor import measure  # bench/, this script's folder

    from edgellm.program import Program

    prompt = torch.randint(0, 60000, (prefill,), generator=torch.Generator().manual_seed(0))
    prefill_tok_s, decode_tok_s = measure(Program(pte), prompt.tolist(), steps)
    return dict(prefill_tokens=prefill, prefill_tok_s=round(prefill_tok_s, 1),
                decode_ms_median=round(1e3 / decode_tok_s, 2), decode_tok_s=round(decode_tok_s, 2))


def summarize(config, folder, log):
    report = json.loads((Path(folder) / "report.json").read_text())
    wall, rss = wall_and_rss(Path(log).read_text())
    d = report["methods"]["forward"]["delegation"]
    row = dict(tool="edgellm", config=config, ok=True, wall_s=wall, peak_rss_mb=rss,
               pte_bytes=report["pte_bytes"], delegated_subgraphs=d["subgraphs"],
               delegated_nodes=d["delegated_nodes"], non_delegated_nodes=d["non_delegated_nodes"],
               non_delegated_compute_nodes=d["non_delegated_compute_nodes"],
               deprecation_warnings=report["deprecation_warnings"])
    if config.startswith("xnnpack"):
        row.update(decode_speed(Path(folder) / "model.pte"))
        anchor = Path(folder).parent / f"anchor_{config.removesuffix('_emb4')}.pte"
        if anchor.is_file():  # the reference's program again, here: same runtime and settings
            row["anchor_here"] = decode_speed(anchor)
    if report.get("delegates", {}).get("coreml"):
        forward = next(d for d in report["delegates"]["coreml"] if d["method"] == "forward")
        row.update(mil_ops=forward["mil_ops"], mil_histogram=forward["mil_histogram"],
                   core_ml_states=len(forward["states"]))
    print(json.dumps(row))


def core_ml_payload(pte: Path) -> dict:
    """MIL figures of the forward Core ML delegate of any program (the reference's included)."""
    from edgellm.backends.coreml_payload import describe_payloads

    for d in describe_payloads(pte):
        if d["method"] == "forward":
            return dict(mil_ops=d["mil_ops"], mil_histogram=d["mil_histogram"],
                        core_ml_states=len(d["states"]))
    return {}


def table(anchor_path, ours_path):
    anchor = {r["config"]: r for r in map(json.loads, Path(anchor_path).read_text().splitlines())}
    ours = {r["config"]: r for r in map(json.loads, Path(ours_path).read_text().splitlines())}
    for c, row in anchor.items():
        pte = Path(anchor_path).parent / f"anchor_{c}.pte"
        if c.startswith("coreml") and pte.is_file():
            row.update(core_ml_payload(pte))
    keys = ["wall_s", "peak_rss_mb", "pte_bytes", "delegated_subgraphs", "delegated_nodes",
            "non_delegated_nodes", "deprecation_warnings", "mil_ops", "core_ml_states",
            "decode_tok_s", "prefill_tok_s"]
    out = {}
    print("| config | figure | export_llm | edgellm | ratio |\n|---|---|---|---|---|")
    for c in ours:  # an edgellm-only variant (xnnpack_q8da4w_emb4) sits beside its base config
        a, e = anchor.get(c, anchor.get(c.removesuffix("_emb4"), {})), ours[c]
        # speeds side by side only when measured in one process (anchor.sh's own run differs in
        # process and OpenMP setting)
        a = {**a, **e["anchor_here"]} if "anchor_here" in e else \
            {k: v for k, v in a.items() if k not in ("decode_tok_s", "prefill_tok_s")}
        out[c] = {"export_llm": a, "edgellm": e, "ratio": {}}
        for k in keys:
            if a.get(k) is None or e.get(k) is None:
                continue
            ratio = round(e[k] / a[k], 3) if a[k] else None
            out[c]["ratio"][k] = ratio
            print(f"| {c} | {k} | {a[k]} | {e[k]} | {ratio} |")
        if "mil_histogram" in a and "mil_histogram" in e:
            print(f"\nMIL operations of {c} (constants excluded):\n\n"
                  "| MIL op | export_llm | edgellm |\n|---|---|---|")
            for op in sorted(set(a["mil_histogram"]) | set(e["mil_histogram"])):
                print(f"| {op} | {a['mil_histogram'].get(op, 0)} | "
                      f"{e['mil_histogram'].get(op, 0)} |")
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2], sys.argv[3])
    else:
        from edgellm.run.openmp import one_thread_per_team

        one_thread_per_team()  # before torch is imported: programs run as in edgellm bench
        summarize(*sys.argv[1:4])
