"""XNNPACK lowering that shares the weights and skips retraces of unchanged graphs
(backends/xnnpack_lean.py): the same model.pte as ExecuTorch's own lowering, a program that
verifies, weights written from the tensors themselves, fewer retraces; the copy hook shares only
weights that own their storage, and a pass that rewrites still retraces."""

import copy
import io

import pytest
import torch

import edgellm
from edgellm.backends import UPSTREAM_COPIES, xnnpack
from edgellm.errors import InputError

SIZES = dict(max_seq_len=16, max_context_len=32)


@pytest.fixture
def lean():
    """The workaround module; skips where the guard leaves ExecuTorch alone (not 1.5)."""
    from executorch.version import __version__

    if not __version__.startswith("1.5."):
        pytest.skip(f"the workarounds apply to ExecuTorch 1.5 only, not {__version__}")
    from edgellm.backends import xnnpack_lean

    return xnnpack_lean


@pytest.fixture
def written_from_tensors(lean, monkeypatch):
    """Sizes of the named-data buffers written into a .pte straight from tensor memory."""
    sizes = []
    upstream = lean.TensorBackedData.write_to_file

    def counting(self, outfile):
        sizes.append(len(self))
        upstream(self, outfile)

    monkeypatch.setattr(lean.TensorBackedData, "write_to_file", counting)
    return sizes


@pytest.fixture
def retraces(monkeypatch):
    """A list that counts ExportPass retraces (its `call`) while a test runs."""
    from executorch.exir.pass_base import _ExportPassBase

    count, upstream = [], _ExportPassBase.call

    def counting(self, graph_module):
        count.append(type(self).__name__)
        return upstream(self, graph_module)

    monkeypatch.setattr(_ExportPassBase, "call", counting)
    return count


@pytest.mark.parametrize("arch, options", [
    ("lfm2", {}), ("llama", {}), ("lfm2", {"quantize": "8da4w", "group_size": 32}),
    ("llama", {"quantize": "8da4w", "group_size": 32}), ("lfm2", {"embedding_quantize": "4,32"})])
def test_lean_lowering_gives_the_upstream_bytes_and_verifies(tiny_models, tmp_path, monkeypatch,
                                                             written_from_tensors, retraces,
                                                             arch, options):
    from executorch.devtools.etrecord import parse_etrecord

    folder, hf = tiny_models[arch]
    monkeypatch.setenv(UPSTREAM_COPIES, "1")
    edgellm.export(folder, output=tmp_path / "upstream", backends="xnnpack", verify=False,
                   quiet=True, etrecord=True, **SIZES, **options)
    assert written_from_tensors == []  # ExecuTorch's own lowering keeps bytes
    upstream_retraces = len(retraces)
    retraces.clear()
    monkeypatch.delenv(UPSTREAM_COPIES)
    report = edgellm.export(folder, output=tmp_path / "lean", backends="xnnpack", quiet=True,
                            etrecord=True, **SIZES, **options)
    assert report["verify"]["passed"]
    upstream, ours = ((tmp_path / n / "model.pte").read_bytes() for n in ("upstream", "lean"))
    assert len(ours) > 10_000 and ours == upstream
    assert written_from_tensors  # the workaround applied
    # XNNPACK's passes found nothing to rewrite in most partitions, and verify's own exports
    # retrace nothing through XNNPACK: fewer retraces, all of lowering's included
    assert 0 < len(retraces) < upstream_retraces * 0.7
    # devtools map the program's instructions and delegates to the graph as they did
    theirs, mine = (parse_etrecord(str(tmp_path / n / "etrecord.bin"))
                    for n in ("upstream", "lean"))
    assert mine._delegate_map == theirs._delegate_map and mine._delegate_map
    assert mine._debug_handle_map == theirs._debug_handle_map
    if not options.get("quantize"):  # 8da4w's weights are repacked to 4 bits, so they stay bytes
        embed = hf.get_input_embeddings().weight  # outside the delegate
        linears = sum(p.nbytes for p in hf.parameters() if p.dim() == 2 and p is not embed)
        assert sum(written_from_tensors) >= linears  # every linear's weight, none as bytes


def test_the_copy_shares_only_weights_that_own_their_storage(lean):
    """A chunk of a fused weight (LFM2's in_proj) shares a storage three times its size: XNNPACK
    would serialize all of it, so such a view is copied (compact) and a whole tensor shared."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            fused = torch.randn(12, 4)
            self.whole = torch.nn.Parameter(torch.randn(4, 4))
            self.first = torch.nn.Parameter(fused.chunk(3)[0])  # offset 0, storage 3x
            self.middle = torch.nn.Parameter(fused.chunk(3)[1])  # offset 16

        def forward(self, x):
            return x @ self.whole + x @ self.first + x @ self.middle

    ep = torch.export.export(Two(), (torch.randn(2, 4),))
    lean.install()
    twin = XnnpackBackend.copy_exported_program_for_preprocess(ep, [])
    assert twin.state_dict["whole"] is ep.state_dict["whole"]
    for name in ("first", "middle"):
        copied = twin.state_dict[name]
        assert copied is not ep.state_dict[name] and torch.equal(copied, ep.state_dict[name])
        assert copied.storage_offset() == 0 and copied.untyped_storage().nbytes() == 64
    assert twin.graph_module is not ep.graph_module


def test_tensor_backed_data_passes_through_the_store_and_the_cord(lean):
    from executorch.exir._serialize._cord import Cord
    from executorch.exir._serialize._named_data_store import NamedDataStore

    weight = torch.randn(8, 16)
    blob = bytes(weight.untyped_storage())
    buffers = [blob]
    assert lean.back_with_weights(buffers, [weight[:4], torch.randn(8, 16), weight]) == 1
    backed = buffers[0]
    assert isinstance(backed, lean.TensorBackedData) and copy.deepcopy(backed) is backed
    assert len(backed) == len(blob) and backed.prefix(32) == blob[:32] and backed.equals(blob)
    one, other = NamedDataStore(), NamedDataStore()
    one.add_named_data("w", backed, alignment=16)
    other.add_named_data("w_again", blob, alignment=16)
    other.merge_named_data_store(one.get_named_data_store_output())  # dedup by sha256
    assert len(other.buffers) == 1 and other.key_to_buffer_idx == {"w_again": 0, "w": 0}
    out = io.BytesIO()
    Cord(backed).write_to_file(out)
    assert out.getvalue() == blob == backed.to_bytes()


def test_a_pass_that_rewrites_still_retraces_and_one_that_does_not_is_handed_back(lean, retraces):
    """The guard sits between a pass and ExportPass: an unchanged graph comes back as it is, a
    changed one is retraced (its new node gets its shape); the graph preprocess received is
    retraced whatever happens, as upstream's first retracing pass does."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir.pass_base import ExportPass

    class Finds(ExportPass):
        rewrite = False

        def call(self, graph_module):
            if self.rewrite:  # x -> neg(x) before the output
                out = graph_module.graph.output_node()
                with graph_module.graph.inserting_before(out):
                    neg = graph_module.graph.call_function(torch.ops.aten.neg.default,
                                                           (out.args[0][0],))
                out.args = ((neg,),)
                graph_module.recompile()
            return super().call(graph_module)

    class Rewrites(Finds):
        rewrite = True

    def run(*passes):
        ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
        retraces.clear()
        return XNNPACKPassManager(ep, passes=list(passes)).transform(), list(retraces)

    lean.install()
    ep, seen = run(Finds, Finds, Finds)
    assert seen == ["Finds"]  # the first (the received graph); the other two handed back
    ep, seen = run(Finds, Rewrites, Finds)
    assert seen == ["Finds", "Rewrites"]
    neg = [n for n in ep.graph.nodes if n.target == torch.ops.aten.neg.default]
    assert len(neg) == 1 and neg[0].meta["val"].shape == (2, 4)  # retraced: shape known
    x = torch.randn(2, 4)
    assert torch.equal(ep.module()(x), -torch.nn.functional.linear(x, ep.state_dict["weight"],
                                                                   ep.state_dict["bias"]))
    lean.restore()
    ep, seen = run(Finds, Finds, Finds)
    assert seen == ["Finds"] * 3  # ExecuTorch's own manager retraces every time


def test_partitioners_install_the_workaround_and_the_variable_removes_it(lean, monkeypatch):
    monkeypatch.setenv(UPSTREAM_COPIES, "1")
    xnnpack._partitioners(None)
    assert not lean.installed()
    monkeypatch.delenv(UPSTREAM_COPIES)
    xnnpack._partitioners(None)
    xnnpack._partitioners(None)  # idempotent: wrapped once
    assert lean.installed()
    monkeypatch.setenv(UPSTREAM_COPIES, "yes")
    with pytest.raises(InputError, match="EDGELLM_UPSTREAM_COPIES='yes' is not understood. "
                                         r"Allowed: 0 .* or 1"):
        xnnpack._partitioners(None)


def test_other_executorch_versions_lower_as_executorch_does(lean, monkeypatch):
    import executorch.version

    monkeypatch.setenv(UPSTREAM_COPIES, "1")
    xnnpack._partitioners(None)
    monkeypatch.delenv(UPSTREAM_COPIES)
    monkeypatch.setattr(executorch.version, "__version__", "1.6.0")
    xnnpack._partitioners(None)
    assert not lean.installed()


def test_the_partitioner_answers_without_a_check_only_when_every_node_passes(lean):
    """XNNPACK's check accepts an fp32 linear and rejects an fp64 one: with every node accepted
    ExecuTorch gets no check function (one decomposition instead of three), otherwise its own."""
    def answer(dtype):
        model = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(dtype)
        ep = torch.export.export(model, (torch.randn(2, 8, dtype=dtype),)).run_decompositions({})
        return xnnpack._partitioners(None)[0].ops_to_not_decompose(ep)

    ops, check = answer(torch.float32)
    assert check is None and torch.ops.aten.linear.default in ops
    ops, check = answer(torch.float64)
    assert check is not None and torch.ops.aten.linear.default in ops


@pytest.fixture
def exir_lean():
    from executorch.version import __version__

    if not __version__.startswith("1.5."):
        pytest.skip(f"the workaround applies to ExecuTorch 1.5 only, not {__version__}")
    from edgellm.backends import exir_lean

    exir_lean.restore()  # an export before this test installed it
    yield exir_lean
    exir_lean.restore()


@pytest.mark.parametrize("retracer", ["executorch", "torch.export"])
def test_a_retrace_runs_each_torchao_op_once_per_shape(exir_lean, monkeypatch, retracer):
    """Two 8da4w linears of one shape: their torchao ops run on fake tensors once for both, in
    the first retrace only; every node gets the metadata a full run gives; restore() undoes it.
    Both pass bases ExecuTorch's lowering retraces with; edge-dialect targets too."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.pass_base import ExportPass
    from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass
    from torchao.quantization import quantize_

    from edgellm.quantize import _torchao

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model.requires_grad_(False)  # as edgellm's models: a grad flag is part of the metadata
    quantize_(model, _torchao(4, 32, dynamic=True))
    ep = torch.export.export(model, (torch.randn(3, 64),),
                             dynamic_shapes=({0: torch.export.Dim("tokens", max=16)},))
    ops = [n.target for n in ep.graph.nodes if exir_lean.memoizable(n.target)]
    assert len(ops) >= 6 and not exir_lean.memoizable(torch.ops.aten.linear.default)
    assert exir_lean.memoizable(exir_ops.edge.torchao.choose_qparams_affine.default)
    assert not exir_lean.memoizable(exir_ops.edge.aten.linear.default)
    Pass = ExportPass if retracer == "executorch" else ReplaceViewOpsWithViewCopyOpsPass
    runs = []
    upstream = torch.fx.Interpreter.call_function

    def counting(self, target, args, kwargs):
        if exir_lean.memoizable(target):
            runs.append(target)
        return upstream(self, target, args, kwargs)

    monkeypatch.setattr(torch.fx.Interpreter, "call_function", counting)

    def retrace():
        runs.clear()
        gm = Pass()(ep.graph_module).graph_module
        vals = [(str(n.target), tuple(map(str, n.meta["val"].shape)), n.meta["val"].dtype)
                for n in gm.graph.nodes if exir_lean.memoizable(n.target)
                for v in [n.meta["val"]] if isinstance(v, torch.Tensor)]
        return vals, len(runs)

    full, n_full = retrace()
    assert n_full == len(ops)  # ExecuTorch's ExportPass runs every one
    exir_lean.install()
    first, n_first = retrace()
    again, n_again = retrace()
    assert first == again == full and full[0][1][0].startswith("s")  # symbolic tokens
    assert n_first == len(ops) // 2 and n_again == 0
    exir_lean.restore()
    assert not exir_lean.installed() and retrace()[1] == len(ops)
