"""Memory of a long export (edgellm/memory.py): checkpoint pages handed back unless written, the
cycle collector set for the run and put back, cycles still freed."""

import collections
import gc
import os
import weakref

import pytest
import torch

from edgellm import memory
from edgellm.cli import main
from edgellm.config import ExportConfig


def resident_kb(path) -> int:
    """Rss of this process's mappings of `path`."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) > 5 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_checkpoint_pages_are_dropped_unless_written(tmp_path):
    from safetensors.torch import load_file, save_file

    weights = {"a": torch.randn(512, 1024), "b": torch.randn(256, 1024)}
    read, written = tmp_path / "read.safetensors", tmp_path / "written.safetensors"
    save_file(weights, read)
    save_file(weights, written)
    mapped = load_file(read)
    other = load_file(written)
    other["b"][0, 0] = 1.0  # a private mapping's written page: dropping it would lose the write
    assert float(sum(t.sum() for t in [*mapped.values(), *other.values()])) != 0  # every page
    before = resident_kb(read.resolve())
    assert before >= 3 * 1024
    assert memory.drop_mapped_pages([read, written]) * 1024 >= before - 1024
    assert resident_kb(read.resolve()) < 64 and resident_kb(written.resolve()) >= 3 * 1024
    assert all(torch.equal(mapped[k], weights[k]) for k in weights)  # faulted back in
    assert other["b"][0, 0] == 1.0
    assert memory.drop_mapped_pages([]) == 0


def test_export_sets_the_cycle_collector_for_its_run_and_puts_it_back(tiny_models, tmp_path,
                                                                      monkeypatch):
    """From the end of `load` the objects alive are frozen and young collections wait (see
    memory.long_run_collector); the caller's collector comes back as it was, also when a stage
    fails."""
    from edgellm import pipeline

    before, seen = gc.get_threshold(), []
    monkeypatch.setattr(pipeline, "release_memory", lambda: seen.append(
        (gc.get_freeze_count(), gc.get_threshold())))
    model = str(tiny_models["llama"][0])
    assert main(["export", model, "-o", str(tmp_path / "o"), "--max-seq-len", "16",
                 "--backend", "coreml", "--no-verify"]) == 0
    assert seen and all(n > 10_000 and t[0] == memory.YOUNG_COLLECTION_EVERY for n, t in seen)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before

    def fail(*a, **k):
        raise RuntimeError("lowering failed")

    monkeypatch.setattr("edgellm.lower.lower", fail)  # export imports it when it runs
    with pytest.raises(RuntimeError, match="lowering failed"):
        pipeline.export(ExportConfig(model=model, output=str(tmp_path / "f"), max_seq_len=16,
                                     backends=("coreml",), verify=False), quiet=True)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_the_long_run_still_frees_the_cycles_it_drops_and_keeps_a_callers_freeze():
    class Node:
        pass

    with memory.long_run_collector():
        node = Node()
        node.itself, node.payload = node, torch.zeros(1 << 20)
        alive = weakref.ref(node)
        del node
        memory.release_memory()
        assert alive() is None
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        # neither frozen again (the count would grow by what was allocated since) nor thawed (0);
        # frozen objects reference counting frees meanwhile make the count drop a little
        with memory.long_run_collector():
            assert 0 < gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


GGUFS = os.path.join(os.path.dirname(__file__), "data", "gguf")


@pytest.mark.parametrize("name, backend", [
    ("llama-Q4_K_M.gguf", "xnnpack"), ("gemma3_text-Q4_K_M.gguf", "xnnpack"),
    ("lfm2-Q4_K_M.gguf", "xnnpack"), ("phi3-Q4_K_M.gguf", "xnnpack"),
    ("llama-Q4_K_M.gguf", "coreml"), ("lfm2-Q4_K_M.gguf", "coreml")])
def test_a_gguf_export_without_verification_reads_one_matrix_at_a_time(monkeypatch, name,
                                                                        backend):
    """With a recipe and no verification (which needs the float model whole), a GGUF's matrices
    stay in the file until quantization takes each: when it reads one, nothing holds a matrix
    read before it (quantized, its float values are gone) but the model itself (a float conv
    kernel), and the quantized model is the one a whole float model gives, tensor for tensor.
    So too through the load-time hooks that split a fused tensor (LFM2's conv in_proj, Phi-3's
    qkv and gate_up), fold norms into linears and fuse q and k (Core ML): a part or a fold is
    read when its linear is quantized. A table quantized by blocks of rows (as a 262,144-row
    one is) is read by those rows, never whole, unless the file keeps it on a 4-bit grid (which
    is found on the whole table)."""
    import gguf

    from edgellm.architectures import pending
    from edgellm.backends import plan_for
    from edgellm.config import resolve_config
    from edgellm.eager import eager_model
    from edgellm.progress import Stages
    from edgellm.quantize import apply, cost
    from edgellm.sources import gguf as gguf_source

    built, held, reads, names = [], [], [], []  # held: at each read, earlier reads alive
    real = pending.Pending.read

    def kept_float(model) -> set:  # what stays float in the model (a conv's kernel) is held
        return {p.untyped_storage().data_ptr() for p in model.parameters()
                if not p.is_meta and not hasattr(p, "__tensor_flatten__")}

    def read(self):
        names.append(self.name)
        gc.collect()
        kept = kept_float(built[0]) if built else set()
        held.append(sum(r() is not None and r().data_ptr() not in kept for r in reads)
                    if built else "before the build")
        out = real(self)
        reads.append(weakref.ref(out.untyped_storage()))
        return out

    monkeypatch.setattr(pending.Pending, "read", read)
    decoded = []  # the file's tensors as they are dequantized, once the build is done
    values = gguf_source._values
    monkeypatch.setattr(gguf_source, "_values", lambda tensors, name: (
        decoded.append(name) if built else None, values(tensors, name))[1])
    for limit in ("ROWS_APART", "EXACT_ROWS_APART"):  # the fixtures' tables and tied heads
        monkeypatch.setattr(apply, limit, 160 * 256 - 1)
    monkeypatch.setattr(cost, "SAMPLED_ROWS", 64)  # costs measured on spans, as a large model's
    monkeypatch.setattr(cost, "SPAN", 16)
    monkeypatch.setattr(apply, "BLOCK_WEIGHTS", 50 * 256)
    path = os.path.join(GGUFS, name)
    cfgs = [resolve_config(model=path, verify=v, max_seq_len=16, backends=backend)
            for v in (False, True)]
    assert cfgs[0].quantize, "the file's own recipe"
    made = lambda stage, model: built.append(model) if stage == "build" else None  # noqa: E731
    lazy = eager_model(cfgs[0], plan_for(cfgs[0]), Stages(quiet=True), made).model
    matrices = {t.name for t in gguf.GGUFReader(path).tensors if len(t.shape) >= 2}
    assert set(names) >= matrices - {"token_embd.weight"} and held == [0] * len(held)
    table = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    on_grid = table.tensor_type.name in ("Q4_0", "Q4_1", "Q4_K")  # found on the whole table
    assert names.count("token_embd.weight") == on_grid
    # each matrix dequantized from the file once, however many spans its cost samples; a fused
    # one once per part it is split into (LFM2's in_proj, Phi-3's qkv: 3; Phi-3's gate_up: 2)
    fused = {"in_proj": 3, "qkv": 3, "ffn_up": 2 if name.startswith("phi3") else 1}
    assert decoded and all(n == next((v for f, v in fused.items() if f in k), 1)
               for k, n in collections.Counter(decoded).items()), collections.Counter(decoded)
    count = len(held)
    whole = eager_model(cfgs[1], plan_for(cfgs[1]), Stages(quiet=True)).model
    assert len(held) == count  # verified: read whole at load, not through Pending
    ours, theirs = lazy.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        a, b = ours[name], tensor
        if hasattr(b, "__tensor_flatten__"):
            fields, _ = b.__tensor_flatten__()
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields), name
        else:
            assert torch.equal(a, b), name


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux only")
def test_the_peak_is_the_process_own_not_a_parent_s_that_once_held_more():
    """A process started by one that held 400 MB reports its own peak, not the parent's (Linux
    carries getrusage's ru_maxrss across exec)."""
    import subprocess
    import sys

    held = bytearray(400 << 20)
    held[::4096] = b"\1" * len(held[::4096])  # resident
    child = subprocess.run([sys.executable, "-c", "from edgellm.memory import peak_rss_mb; "
                            "print(peak_rss_mb())"], capture_output=True, text=True, check=True)
    assert float(child.stdout) < 200
    assert memory.peak_rss_mb() >= 400
