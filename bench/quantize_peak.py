"""Where the quantize stage's peak comes from: an export of FILE with its default recipe,
`--no-verify`, with each torchao `quantize_` call over a tensor of more than 50M weights
wrapped, printing the process's RSS before it, its peak during it (Linux: VmHWM, reset before
the call through /proc/self/clear_refs) and RSS after it; then each stage's peak as the report
gives it, which past the last reset is what the stages after quantization reach.

usage: python bench/quantize_peak.py FILE.gguf [--backend xnnpack] [--out DIR]
"""

import argparse
import tempfile
from pathlib import Path

LARGE = 50_000_000


def _status() -> tuple[int, int]:
    """(peak, current) RSS in MB."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmHWM", "VmRSS")):
            values[line.split(":")[0]] = int(line.split()[1]) // 1024
    return values["VmHWM"], values["VmRSS"]


def main():
    import torchao.quantization as torchao_quantization

    import edgellm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--backend", default="xnnpack")
    p.add_argument("--out")
    a = p.parse_args()
    original = torchao_quantization.quantize_

    def watched(model, config, filter_fn=None, *args, **kwargs):
        large = [(name, tuple(m.weight.shape)) for name, m in model.named_modules()
                 if getattr(getattr(m, "weight", None), "numel", lambda: 0)() > LARGE
                 and (filter_fn is None or filter_fn(m, name))]
        before = _status()[1]
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        out = original(model, config, filter_fn, *args, **kwargs)
        peak, after = _status()
        if large:
            print(f"{type(config).__name__} on {large}: RSS {before} MB before, peak {peak} MB "
                  f"(+{peak - before}), {after} MB after", flush=True)
        return out

    torchao_quantization.quantize_ = watched
    with tempfile.TemporaryDirectory() as tmp:
        report = edgellm.export(a.file, output=a.out or Path(tmp) / "out", backends=a.backend,
                                verify=False, force=True, quiet=True, max_seq_len=128)
    # the report reads VmHWM too: past the last reset, its stage peaks are what follows the calls
    print("stage peaks, MB (after a call above, since its reset):",
          [(s["name"], s["peak_rss_mb"]) for s in report["stages"]])


if __name__ == "__main__":
    main()
