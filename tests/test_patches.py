"""edgellm's patches of ExecuTorch, coremltools and torch internals (edgellm/patches/): each is
written against the upstream function it replaces (a digest of its source, compared here: a test
that fails when upstream changes), is switched by EDGELLM_NO_PATCHES, is not applied where it
does not fit, and gives the bytes upstream's code gives; then what each patch does, unit by unit.
"""

import copy
import io

import numpy as np
import pytest
import torch

import edgellm
from conftest import SIZES
from edgellm import patches
from edgellm.errors import InputError
from edgellm.lower import LOWERING_PATCHES


def by_name(module: str) -> dict:
    return {p.name.split(".", 1)[1]: p for p in patches.patches_of(module)}


@pytest.fixture
def xnnpack_patches():
    """{name: Patch} of patches/xnnpack.py; upstream's code is back after the test."""
    yield by_name("xnnpack")
    for p in by_name("xnnpack").values():
        p.restore()


@pytest.fixture
def coreml_patches():
    yield by_name("coreml")
    for p in by_name("coreml").values():
        p.restore()


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


@pytest.fixture
def composite_patch():
    patch = by_name("exir")["composite_fake_runs"]
    patch.restore()  # an export before this test installed it
    yield patch
    patch.restore()


def test_every_patch_is_written_against_the_upstream_installed_here():
    """A patch pins the upstream functions it replaces or relies on by a digest of their source.
    When ExecuTorch, coremltools or torch change one, this fails naming it: read the new
    function, check the patch still gives upstream's bytes, and update the digest."""
    for patch in patches.everything():
        assert patch.mismatched_versions() == [], patch.name
        assert patch.changed() == [], (f"{patch.name}: upstream changed {patch.changed()}; found "
                                       f"{ {p: patch.found[p] for p in patch.changed()} }")
        assert patch.summary and patch.pins


def test_a_patch_is_applied_only_where_it_fits(monkeypatch, xnnpack_patches):
    shared = xnnpack_patches["shared_weights"]
    assert patches.apply(["xnnpack.shared_weights"]) == {"xnnpack.shared_weights": "on"}
    assert shared.installed()
    pin = next(iter(shared.pins))
    monkeypatch.setitem(shared.found, pin, "0" * 16)  # as if upstream had changed
    assert patches.apply(["xnnpack.shared_weights"]) == {
        "xnnpack.shared_weights": f"off: changed upstream: {pin}"}
    assert not shared.installed()
    monkeypatch.undo()
    monkeypatch.setattr(patches, "installed_version", lambda dist: "1.6.0")
    status = patches.apply(["xnnpack"])
    assert set(status.values()) == {"off: executorch 1.6.0 (written for 1.5.x)"}
    assert not any(p.installed() for p in xnnpack_patches.values())


def test_patches_whose_module_cannot_import_are_off_not_an_error(monkeypatch):
    """A future ExecuTorch that moved what a patch module imports: the export lowers as upstream
    does and the report says why."""
    def missing(module):
        raise ImportError(f"cannot import name 'Moved' from executorch ({module})")

    monkeypatch.setattr(patches, "patches_of", missing)
    assert patches.apply(["vulkan"]) == {"vulkan": "off: vulkan patches do not import here "
                                         "(ImportError: cannot import name 'Moved' from "
                                         "executorch (vulkan))"}


def test_the_environment_switches_patches_off(monkeypatch, xnnpack_patches):
    monkeypatch.setenv(patches.SWITCH, "xnnpack.skip_retraces")
    status = patches.apply(["xnnpack"])
    assert status["xnnpack.skip_retraces"] == "off: EDGELLM_NO_PATCHES"
    assert status["xnnpack.shared_weights"] == status["xnnpack.one_decomposition"] == "on"
    monkeypatch.setenv(patches.SWITCH, "all")
    assert set(patches.apply(["xnnpack", "exir"]).values()) == {"off: EDGELLM_NO_PATCHES"}
    monkeypatch.setenv(patches.SWITCH, "xnnpack.shared_weight")
    with pytest.raises(InputError, match=r"EDGELLM_NO_PATCHES='xnnpack.shared_weight' names no "
                       r"patch: xnnpack.shared_weight\. Give 'all', a module \(xnnpack, coreml, "
                       r"vulkan, exir, fusion, partition, emit, torchao\) or patch names: "
                       r"xnnpack.shared_weights, "):
        patches.apply(["xnnpack"])


@pytest.mark.parametrize("backend, options", [
    ("xnnpack", {"quantize": "8da4w", "group_size": 128, "embedding_quantize": "4,32"}),
    ("coreml", {}), ("coreml", {"quantize": "4w"})])
def test_patched_lowering_gives_the_upstream_bytes(small_lfm2, tmp_path, monkeypatch, backend,
                                                   options):
    """Every patch off (EDGELLM_NO_PATCHES=all), then on and the export verified: the same
    model.pte (so the patches and verification change no byte, and the export repeats), and the
    same delegate and debug-handle maps in the ETRecord. A 2-layer LFM2 (conv, attention) whose
    XNNPACK recipe leaves its 64-wide linears in float (the in_proj chunks are views of one
    weight), makes its 128-wide ones 8da4w (torchao's HQQ and quantize ops) and its table 4-bit
    (ExecuTorch's quant fusion)."""
    from executorch.devtools.etrecord import parse_etrecord

    folder = small_lfm2
    monkeypatch.setenv(patches.SWITCH, "all")
    upstream = edgellm.export(folder, output=tmp_path / "upstream", quiet=True, backends=backend,
                              etrecord=True, verify=False, **SIZES, **options)
    assert set(upstream["patches"].values()) == {"off: EDGELLM_NO_PATCHES"}
    monkeypatch.delenv(patches.SWITCH)
    ours = tmp_path / "ours"
    report = edgellm.export(folder, output=ours, quiet=True, backends=backend, etrecord=True,
                            **SIZES, **options)
    assert report["verify"]["passed"] and set(report["patches"].values()) == {"on"}
    # the lowering's, and torchao's where a recipe quantizes linears
    assert len(report["patches"]) == (len(LOWERING_PATCHES) + len(patches.patches_of(backend))
                                      + ("quantize" in options))
    if options.get("group_size") == 128:
        q = report["quantization"]
        assert q["linears_quantized"] == 2 and len(q["linears_left_float"]) == 13
    theirs_pte, ours_pte = (f / "model.pte" for f in (tmp_path / "upstream", ours))
    assert len(ours_pte.read_bytes()) > 10_000 and ours_pte.read_bytes() == theirs_pte.read_bytes()
    theirs, mine = (parse_etrecord(str(f / "etrecord.bin")) for f in (tmp_path / "upstream", ours))
    assert mine._delegate_map == theirs._delegate_map and mine._delegate_map
    assert mine._debug_handle_map == theirs._debug_handle_map


# --- xnnpack.shared_weights ---------------------------------------------------------------------

from edgellm.patches import coreml, exir, torchao, xnnpack  # noqa: E402  (imports backends)


def test_the_copy_shares_only_weights_that_own_their_storage(xnnpack_patches):
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
    xnnpack_patches["shared_weights"].install()
    twin = XnnpackBackend.copy_exported_program_for_preprocess(ep, [])
    assert twin.state_dict["whole"] is ep.state_dict["whole"]
    for name in ("first", "middle"):
        copied = twin.state_dict[name]
        assert copied is not ep.state_dict[name] and torch.equal(copied, ep.state_dict[name])
        assert copied.storage_offset() == 0 and copied.untyped_storage().nbytes() == 64
    assert twin.graph_module is not ep.graph_module


def test_tensor_backed_data_passes_through_the_store_and_the_cord(xnnpack_patches):
    from executorch.exir._serialize._cord import Cord
    from executorch.exir._serialize._named_data_store import NamedDataStore

    weight = torch.randn(8, 16)
    blob = bytes(weight.untyped_storage())
    buffers = [blob]
    assert xnnpack.back_with_weights(buffers, [weight[:4], torch.randn(8, 16), weight]) == 1
    backed = buffers[0]
    assert isinstance(backed, xnnpack.TensorBackedData) and copy.deepcopy(backed) is backed
    assert len(backed) == len(blob) and backed.prefix(32) == blob[:32] and backed.equals(blob)
    one, other = NamedDataStore(), NamedDataStore()
    one.add_named_data("w", backed, alignment=16)
    other.add_named_data("w_again", blob, alignment=16)
    other.merge_named_data_store(one.get_named_data_store_output())  # dedup by sha256
    assert len(other.buffers) == 1 and other.key_to_buffer_idx == {"w_again": 0, "w": 0}
    out = io.BytesIO()
    Cord(backed).write_to_file(out)
    assert out.getvalue() == blob == backed.to_bytes()


# --- emit.constants_by_reference -------------------------------------------------------------


def test_constants_kept_by_reference_write_the_upstream_bytes(tiny_models, tmp_path, monkeypatch):
    """The emitter keeps a constant outside every delegate (here a mixture-of-experts block's
    packed experts, and the embedding table) as its tensor's storage, not a copy in bytes, and
    the .pte is upstream's byte for byte (every constant taken by reference: threshold 1)."""
    from edgellm.patches import emit

    kept = []
    monkeypatch.setattr(emit, "BY_REFERENCE_FROM", 1)
    monkeypatch.setattr(emit, "TensorBackedData", lambda t: kept.append(
        xnnpack.TensorBackedData(t)) or kept[-1])
    options = dict(quiet=True, quantize="8da4w", group_size=32, experts="op", verify=False,
                   etrecord=False, max_seq_len=16, max_context_len=48)
    folder = tiny_models["lfm2_moe"][0]
    monkeypatch.setenv(patches.SWITCH, "emit")
    edgellm.export(folder, output=tmp_path / "upstream", **options)
    assert not kept
    monkeypatch.delenv(patches.SWITCH)
    report = edgellm.export(folder, output=tmp_path / "ours", **options)
    assert report["patches"]["emit.constants_by_reference"] == "on"

    def blob(rows, k):  # torchao's layout: header; per row 4-bit values, a scale and sum a group
        return 64 + rows * (k // 2 + 8 * k // 32)

    sizes = [k._size for k in kept]  # per sparse block (2): w13 (2F=64, D=64), w2 (D=64, F=32)
    assert sizes.count(8 * blob(64, 64)) == sizes.count(8 * blob(64, 32)) == 2, sizes
    assert (tmp_path / "ours" / "model.pte").read_bytes() == (
        tmp_path / "upstream" / "model.pte").read_bytes()


def test_a_program_with_a_cond_per_expert_gets_the_upstream_bytes(tiny_models, tmp_path,
                                                                  monkeypatch):
    """`--experts chosen` (a one-layer Qwen3-MoE of 4 experts here, LFM2-MoE's in test_moe: a
    cond and a delegate per expert: 8 branches): every patch off, then on, the same model.pte;
    with them, torch's pass that puts the in-place ops back runs once per method instead of once
    per submodule."""
    import torch.export._remove_auto_functionalized_pass as pass_module

    from conftest import save_model

    options = dict(quiet=True, quantize="8da4w", group_size=32, experts="chosen", verify=False,
                   etrecord=False, max_seq_len=16, max_context_len=48)
    config = copy.deepcopy(tiny_models["qwen3_moe"][1].config)
    config.num_hidden_layers, config.mlp_only_layers = 1, []  # upstream's pass is quadratic
    config.num_experts = 4
    folder = tmp_path / "qwen3_moe-1"
    save_model(config, folder)
    monkeypatch.setenv(patches.SWITCH, "all")
    edgellm.export(folder, output=tmp_path / "upstream", **options)
    monkeypatch.delenv(patches.SWITCH)
    runs = []
    decompose = pass_module.decompose_auto_functionalized
    monkeypatch.setattr("torch._inductor.fx_passes.post_grad.decompose_auto_functionalized",
                        lambda graph: runs.append(graph) or decompose(graph))
    report = edgellm.export(folder, output=tmp_path / "ours", **options)
    assert report["patches"]["emit.functionalization_removed_once"] == "on" and len(runs) == 1
    assert (tmp_path / "ours" / "model.pte").read_bytes() == (
        tmp_path / "upstream" / "model.pte").read_bytes()


# --- xnnpack.skip_retraces and xnnpack.one_decomposition -----------------------------------


def test_a_pass_that_rewrites_still_retraces_and_one_that_does_not_is_handed_back(
        xnnpack_patches, retraces):
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

    xnnpack_patches["skip_retraces"].install()
    ep, seen = run(Finds, Finds, Finds)
    assert seen == ["Finds"]  # the first (the received graph); the other two handed back
    ep, seen = run(Finds, Rewrites, Finds)
    assert seen == ["Finds", "Rewrites"]
    neg = [n for n in ep.graph.nodes if n.target == torch.ops.aten.neg.default]
    assert len(neg) == 1 and neg[0].meta["val"].shape == (2, 4)  # retraced: shape known
    x = torch.randn(2, 4)
    assert torch.equal(ep.module()(x), -torch.nn.functional.linear(x, ep.state_dict["weight"],
                                                                   ep.state_dict["bias"]))
    xnnpack_patches["skip_retraces"].restore()
    ep, seen = run(Finds, Finds, Finds)
    assert seen == ["Finds"] * 3  # ExecuTorch's own manager retraces every time


def test_xnnpacks_passes_check_the_program_before_the_first_and_after_the_last(
        xnnpack_patches, monkeypatch):
    """Upstream checks the program (recompile, lint, call_method, verifier) before and after
    each of XNNPACK's passes, two checks per pass of which every inner pair sees the same graph;
    with the patch, one before the first and one after the last. A pass that leaves the graph
    broken (a call_method node) still fails the export, with upstream's error."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir.error import ExportError
    from executorch.exir.pass_base import ExportPass
    from executorch.exir.pass_manager import ExportedProgramPassManager
    from torch.fx.passes.infra.pass_base import PassResult

    checks, upstream = [], ExportedProgramPassManager.check
    monkeypatch.setattr(ExportedProgramPassManager, "check",
                        lambda self, ep: checks.append(1) or upstream(self, ep))

    class Keeps(ExportPass):
        pass

    class Breaks(ExportPass):  # x -> x.relu() as a method call, which the check refuses
        def call(self, graph_module):
            out = graph_module.graph.output_node()
            with graph_module.graph.inserting_before(out):
                relu = graph_module.graph.call_method("relu", (out.args[0][0],))
            out.args = ((relu,),)
            graph_module.recompile()
            return PassResult(graph_module, True)

    def run(*passes):
        ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
        checks.clear()
        XNNPACKPassManager(ep, passes=list(passes)).transform()
        return len(checks)

    xnnpack_patches["checks_at_ends"].restore()  # an export before this test installed it
    xnnpack_patches["skip_retraces"].install()
    assert run(Keeps, Keeps, Keeps) == 6
    with pytest.raises(ExportError, match="call_method `relu` is not supported"):
        run(Keeps, Breaks, Keeps)
    xnnpack_patches["checks_at_ends"].install()
    assert run(Keeps, Keeps, Keeps) == 2
    with pytest.raises(ExportError, match="call_method `relu` is not supported"):
        run(Keeps, Breaks, Keeps)
    xnnpack_patches["checks_at_ends"].restore()
    assert run(Keeps, Keeps, Keeps) == 6


def test_the_partitioner_reads_the_signature_once(xnnpack_patches, monkeypatch):
    """XNNPACK's configs ask the program's signature, for each node and argument, whether it is
    a parameter, and upstream's signature builds a new dict of every input for each question:
    with the patch, one dict per partitioning and the same partitions; the program keeps its
    own signature; should the signature change while partitioning, upstream's runs again."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from torch.export.graph_signature import ExportGraphSignature

    built, upstream = [], ExportGraphSignature.inputs_to_parameters
    monkeypatch.setattr(ExportGraphSignature, "inputs_to_parameters",
                        property(lambda self: built.append(1) or upstream.fget(self)))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    ep = torch.export.export(model, (torch.randn(2, 8),)).run_decompositions({})
    signature = ep.graph_signature

    def partitions():
        built.clear()
        found = XnnpackPartitioner().generate_partitions(ep)
        assert ep.graph_signature is signature
        return sorted(sorted(n.name for n in p.nodes) for p in found), len(built)

    xnnpack_patches["signature_read_once"].restore()
    theirs, their_builds = partitions()
    xnnpack_patches["signature_read_once"].install()
    ours, our_builds = partitions()
    assert ours == theirs and len(theirs) == 1 and their_builds > 10 and our_builds == 1
    runs, real = [], xnnpack._UPSTREAM_GENERATE

    def changing(self, program):  # a partitioner that renames an input while it reads
        runs.append(1)
        if len(runs) == 1:
            signature.input_specs[0].arg.name += "_renamed"
        return real(self, program)

    monkeypatch.setattr(xnnpack, "_UPSTREAM_GENERATE", changing)
    partitions()
    assert len(runs) == 2


def test_the_partitioner_answers_without_a_check_only_when_every_node_passes(xnnpack_patches):
    """XNNPACK's check accepts an fp32 linear and rejects an fp64 one: with every node accepted
    ExecuTorch gets no check function (one decomposition instead of three), otherwise its own."""
    def answer(dtype):
        model = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(dtype)
        ep = torch.export.export(model, (torch.randn(2, 8, dtype=dtype),)).run_decompositions({})
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return XnnpackPartitioner().ops_to_not_decompose(ep)

    xnnpack_patches["one_decomposition"].install()
    ops, check = answer(torch.float32)
    assert check is None and torch.ops.aten.linear.default in ops
    ops, check = answer(torch.float64)
    assert check is not None and torch.ops.aten.linear.default in ops


# --- xnnpack.unmatchable_patterns --------------------------------------------------------------


@pytest.mark.parametrize("upsampled", [False, True])
def test_the_upsample_pass_matches_only_where_a_pattern_can(xnnpack_patches, monkeypatch,
                                                            upsampled):
    """Each of the pass's patterns holds an upsample_bilinear2d node; a partition without one
    (an LLM's) neither builds nor matches them and lowers to upstream's bytes; one with a
    bilinear upsample is matched as upstream matches it (the same bytes again)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torch.fx.passes.utils import matcher_utils

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 3, 1)

        def forward(self, x):
            x = self.conv(x)
            return torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear") \
                if upsampled else torch.relu(x)

    from executorch.backends.xnnpack.partition.graphs import bilinear_2d

    ep = torch.export.export(Net().eval(), (torch.randn(1, 3, 4, 4),))
    built = bilinear_2d.get_graphs_dict()
    for g in built:
        assert any(n.target is xnnpack._UPSAMPLE for n in g.graph.nodes)
    patterns = {id(g.graph) for g in built}
    asked = []
    monkeypatch.setattr(bilinear_2d, "get_graphs_dict", lambda: asked.append(1) or built)
    matched, upstream = [], matcher_utils.SubgraphMatcher.match

    def match(self, graph, **kwargs):  # the upsample pass's, not the partitioner's
        matched.extend([1] if id(self.pattern) in patterns else [])
        return upstream(self, graph, **kwargs)

    monkeypatch.setattr(matcher_utils.SubgraphMatcher, "match", match)

    def lowered():
        matched.clear(), asked.clear()
        edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
        delegated = sum(n.target.__name__ == "executorch_call_delegate"
                        for n in edge.exported_program().graph.nodes if n.op == "call_function")
        return edge.to_executorch().buffer, (len(asked), len(matched)), delegated

    patch = xnnpack_patches["unmatchable_patterns"]
    patch.restore()
    theirs, their_work, delegates = lowered()
    patch.install()
    ours, our_work, our_delegates = lowered()
    assert ours == theirs and our_delegates == delegates == 1
    assert their_work[0] >= 1 and their_work[1] >= 4
    assert our_work == (their_work if upsampled else (0, 0))


@pytest.mark.parametrize("attends", [False, True])
def test_the_sdpa_pass_matches_only_where_a_pattern_can(xnnpack_patches, monkeypatch, attends):
    """Each of the SDPA pass's patterns holds a `_softmax` node; a partition without one (an
    LLM's, whose attention is custom_sdpa outside XNNPACK) neither builds nor matches them and
    lowers to upstream's bytes; one with an SDPA is matched as upstream matches it."""
    from executorch.backends.xnnpack.partition.graphs import sdpa
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    class Net(torch.nn.Module):
        def forward(self, q, k, v, mask):
            if attends:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return torch.relu(q) + k * v

    args = (torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4),
            torch.zeros(8, 8))
    ep = torch.export.export(Net(), args)
    built = sdpa.get_graphs()
    assert all(any(n.target == xnnpack._SOFTMAX for n in g.graph.nodes) for g in built)
    asked = []
    monkeypatch.setattr(sdpa, "get_graphs", lambda: asked.append(1) or built)

    def lowered():
        asked.clear()
        edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
        return edge.to_executorch().buffer, len(asked)

    patch = xnnpack_patches["unmatchable_sdpa"]
    patch.restore()
    theirs, their_builds = lowered()
    patch.install()
    ours, our_builds = lowered()
    assert ours == theirs and their_builds >= 1
    # upstream asks for the patterns in every partition; the patch where a softmax is
    assert (1 <= our_builds <= their_builds) if attends else our_builds == 0


# --- exir.composite_fake_runs -------------------------------------------------------------------


@pytest.mark.parametrize("retracer", ["executorch", "torch.export"])
def test_a_retrace_runs_each_composite_op_once_per_shape(composite_patch, monkeypatch,
                                                         retracer):
    """Two 8da4w linears of one shape: their torchao ops and the linears themselves run on fake
    tensors once for both, in the first retrace only; every node gets the metadata a full run
    gives; restore() undoes it. Both pass bases ExecuTorch's lowering retraces with; edge-dialect
    targets too."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.pass_base import ExportPass
    from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass
    from torchao.quantization import quantize_

    from edgellm.quantize.recipes import torchao_config

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model.requires_grad_(False)  # as edgellm's models: a grad flag is part of the metadata
    quantize_(model, torchao_config(4, 32, dynamic=True))
    ep = torch.export.export(model, (torch.randn(3, 64),),
                             dynamic_shapes=({0: torch.export.Dim("tokens", max=16)},))
    ops = [n.target for n in ep.graph.nodes if exir.memoizable(n.target)]
    assert len(ops) >= 8 and exir.memoizable(torch.ops.aten.linear.default)
    assert exir.memoizable(exir_ops.edge.torchao.choose_qparams_affine.default)
    assert exir.memoizable(exir_ops.edge.aten.linear.default)
    assert not exir.memoizable(torch.ops.aten.mm.default)  # not composite
    assert not exir.memoizable(torch.ops.aten.reshape.default)  # returns a view
    Pass = ExportPass if retracer == "executorch" else ReplaceViewOpsWithViewCopyOpsPass
    runs = []
    upstream = torch.fx.Interpreter.call_function

    def counting(self, target, args, kwargs):
        if exir.memoizable(target):
            runs.append(target)
        return upstream(self, target, args, kwargs)

    monkeypatch.setattr(torch.fx.Interpreter, "call_function", counting)

    def retrace():
        runs.clear()
        gm = Pass()(ep.graph_module).graph_module
        vals = [(str(n.target), tuple(map(str, n.meta["val"].shape)), n.meta["val"].dtype)
                for n in gm.graph.nodes if exir.memoizable(n.target)
                for v in [n.meta["val"]] if isinstance(v, torch.Tensor)]
        return vals, len(runs)

    full, n_full = retrace()
    assert n_full == len(ops)  # ExecuTorch's ExportPass runs every one
    composite_patch.install()
    first, n_first = retrace()
    again, n_again = retrace()
    assert first == again == full and full[0][1][0].startswith("s")  # symbolic tokens
    assert n_first == len(ops) // 2 and n_again == 0
    composite_patch.restore()
    assert not composite_patch.installed() and retrace()[1] == len(ops)


def test_the_decomposition_runs_each_kept_composite_op_once_per_shape(exir_patches,
                                                                     monkeypatch):
    """torch.export's decomposition keeps the ops a partitioner asks for (torchao's quantize
    ops, linear) and fake-runs each one's Python body for its output, twice per node (AOT's
    metadata pass, then its trace): with the patch, two 8da4w linears of one shape run each
    torchao op once per shape; the program is the one upstream gives (same nodes, same
    metadata); restore() undoes it."""
    from torch.export import exported_program as torch_ep
    from torchao.quantization import quantize_

    from edgellm.quantize.recipes import torchao_config

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model.requires_grad_(False)
    quantize_(model, torchao_config(4, 32, dynamic=True))
    ep = torch.export.export(model, (torch.randn(3, 64),),
                             dynamic_shapes=({0: torch.export.Dim("tokens", max=16)},))
    kept = {n.target for n in ep.graph.nodes if exir.memoizable(n.target)}
    assert torch.ops.aten.linear.default in kept and len(kept) == 4
    table = torch.export.default_decompositions()
    for op in kept:
        table.pop(op, None)
    quantize_nodes = sum(n.target in kept and n.target.namespace == "torchao"
                         for n in ep.graph.nodes)
    runs, upstream = [], torch_ep._get_decomp_for_cia

    def counting(op):  # the body each kept op's fake rule runs
        body = upstream(op)
        return lambda *a, **k: runs.append(op.namespace) or body(*a, **k)

    monkeypatch.setattr(torch_ep, "_get_decomp_for_cia", counting)

    def decomposed():
        runs.clear()
        gm = ep.run_decompositions(table).graph_module
        return ([(n.name, str(n.target), str(n.meta.get("val"))) for n in gm.graph.nodes],
                runs.count("torchao"))

    patch = exir_patches["kept_op_fake_runs"]
    patch.restore()
    theirs, their_runs = decomposed()
    patch.install()
    ours, our_runs = decomposed()
    assert ours == theirs and any("s" in v for _, t, v in ours if "linear" in t)
    # choose_qparams, quantize, dequantize of the activation and of the weight: 4 shapes
    assert quantize_nodes == 8 and their_runs == 2 * quantize_nodes and our_runs == 4
    patch.restore()
    assert not patch.installed() and decomposed()[1] == 2 * quantize_nodes


# --- exir.chained_edge_passes -----------------------------------------------------------------


class EveryEdgeRewrite(torch.nn.Module):
    """Something for each chained pass to rewrite (but NormalizeTranspose, whose `t` the
    decomposition before it already made a permute): views (ReplaceBrokenOps), a scalar operand
    (ScalarToTensor), a symbolic size as a tensor operand (SymToTensor), an int tensor added to a
    float one (RemoveMixedTypeOperators, which inserts a `_to_copy` the later passes rewrite
    again), a dtype copy (MemoryFormatOps), every ATen op (OpReplace)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("steps", torch.arange(8))

    def forward(self, x):
        y = (x @ self.w.t()).view(-1, 2, 4).transpose(1, 2) * 2.0
        y = y.reshape(x.shape[0], 8) * x.shape[0] + self.steps
        return y.to(torch.float16).float().sum(-1, keepdim=True)


def test_chained_edge_passes_give_upstreams_program_in_two_retraces(retraces):
    """ExecuTorch's aten-to-edge conversion with the node-by-node passes chained: the same
    program bytes as upstream's seven retraces, from two; the rewrites each pass makes are in
    the program (else this test would pass with a pass skipped); the pass objects ExecuTorch
    shares between exports are handed back unchanged; restore() undoes it."""
    from executorch.exir import EdgeCompileConfig, to_edge

    ep = torch.export.export(EveryEdgeRewrite(), (torch.randn(3, 8),),
                             dynamic_shapes=({0: torch.export.Dim("tokens", max=16)},))
    chained = by_name("exir")["chained_edge_passes"]

    def lowered():
        retraces.clear()
        edge = to_edge(ep, compile_config=EdgeCompileConfig(_check_ir_validity=False))
        graph = edge.exported_program().graph_module
        ran, edge_graph = list(retraces), (graph.code, " ".join(map(str, graph.graph.nodes)))
        return edge.to_executorch().buffer, edge_graph, ran

    chained.restore()
    theirs, graph, ran = lowered()
    assert chained.installed() is False and len(ran) >= 7
    chained.install()
    try:
        ours, mine, ran_chained = lowered()
        assert ran_chained.count("_Chained") == 2
        assert len(ran) - len(ran_chained) == 5  # seven retraces became two
        assert ours == theirs and mine[0] == graph[0]
        for rewritten in ("aten_view_copy_default", "_lifted_tensor_constant", "scalar_tensor",
                          "dim_order_ops__to_dim_order_copy_default_3"):
            assert rewritten in mine[1], (rewritten, mine[1])
        from executorch.exir.passes import base_pre_op_replace_passes
        shared = [getattr(p, "__wrapped__", p) for p in base_pre_op_replace_passes]
        assert any(exir._chainable(p) for p in shared)
        assert not any("_fx" in vars(p) for p in shared)
    finally:
        chained.restore()
    assert not chained.installed()


# --- exir.one_decomposition_trace, exir.delegate_fake_outputs ---------------------------------


class CastAndDecomposed(torch.nn.Module):
    """A linear whose weight reaches it through a same-dtype `.to` (the traced program's linear
    fails XNNPACK's check, the decomposed one's passes: the cast is gone), a silu and an arange
    (ops the decomposition table rewrites); with `doubled`, an output whose size is twice the
    input's symbolic tokens (an expression, not a symbol)."""

    def __init__(self, doubled: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.v = torch.nn.Parameter(torch.randn(8, 8))
        self.doubled = doubled

    def forward(self, x):
        y = torch.nn.functional.silu(torch.nn.functional.linear(x, self.w.to(torch.float32)))
        y = torch.nn.functional.linear(y, self.v) + torch.arange(8)
        return torch.cat([y, x]) if self.doubled else y


def traced(doubled: bool = False):
    return torch.export.export(CastAndDecomposed(doubled), (torch.randn(3, 8),),
                               dynamic_shapes=({0: torch.export.Dim("tokens", max=16)},))


@pytest.fixture
def exir_patches(xnnpack_patches):
    """{name: Patch} of patches/exir.py, each upstream's until a test installs it; XNNPACK's
    partitioner answers up front (`xnnpack.one_decomposition`), as in every export."""
    for p in by_name("exir").values():
        p.restore()
    xnnpack_patches["one_decomposition"].install()
    yield by_name("exir")
    for p in by_name("exir").values():
        p.restore()


def test_one_decomposition_trace_gives_upstreams_program_from_one_trace(exir_patches,
                                                                        monkeypatch):
    """Functionalized and decomposed in one trace: the bytes of upstream's two; a partitioner
    whose check fails on the decomposed program sends the program down upstream's path (the
    trace spent, the same bytes); restore() undoes it. Partitioners that list the graph's ops
    (Core ML's) or whose check every traced node passes are not tried: no trace spent."""
    import torch.export.exported_program as exported
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    traces, upstream = [], exported._decompose_exported_program
    monkeypatch.setattr(exported, "_decompose_exported_program",
                        lambda *a, **k: traces.append(1) or upstream(*a, **k))
    ep = traced()

    def lowered():
        to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])  # patterns built
        traces.clear()
        return to_edge_transform_and_lower(
            ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer, len(traces)

    patch = exir_patches["one_decomposition_trace"]
    theirs, their_traces = lowered()
    patch.install()
    ours, our_traces = lowered()
    assert (their_traces, our_traces) == (2, 1) and ours == theirs
    with monkeypatch.context() as m:  # XNNPACK's check refusing every linear: upstream's path
        answer = XnnpackPartitioner.ops_to_not_decompose
        m.setattr(XnnpackPartitioner, "ops_to_not_decompose",
                  lambda self, p: (answer(self, p)[0], lambda n: False))
        refused, refused_traces = lowered()
        patch.restore()
        refused_upstream, upstream_traces = lowered()
    assert refused == refused_upstream != theirs and refused_traces == upstream_traces + 1
    assert not patch.installed()

    class Listing:  # ops listed from the graph shown (Core ML's): upstream's path
        def ops_to_not_decompose(self, p):
            return [torch.ops.aten.linear.default], None

    accepting = XnnpackPartitioner()  # a check every node passes (XNNPACK's upstream answer)
    accepting.ops_to_not_decompose = lambda p: (answer(accepting, p)[0], lambda n: True)
    traces.clear()
    assert exir._decomposed_once(ep, [Listing()]) is None and not traces
    assert exir._decomposed_once(ep, [accepting]) is None and not traces


def graph_state(gm) -> tuple:
    """What a topological reorder can change: the nodes' order and names, each node's users and
    inputs in their order, the names the graph would give new nodes."""
    g = gm.graph
    return ([(n.name, str(n.target)) for n in g.nodes], [list(map(str, n.users)) for n in g.nodes],
            [list(map(str, n.all_input_nodes)) for n in g.nodes],
            sorted(g._graph_namespace._used_names), sorted(g._graph_namespace._base_count.items()))


def unsorted_graph(cycle: bool = False):
    """A graph as partitioning leaves it: a node used before it is defined (`neg` moved above
    the `relu` it reads), users and inputs registered in another order than the sorted one
    (`add` reads `relu` before `neg` exists, then `neg` is put first among its arguments), an
    erased node's name, a prioritized `_assert_scalar`."""
    import operator

    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.relu.default, (x,))
    c = g.call_function(torch.ops.aten.add.Tensor, (a,))
    b = g.call_function(torch.ops.aten.neg.default, (a,))
    c.insert_arg(0, b)
    size = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    check = g.call_function(operator.ge, (size, 1))
    g.call_function(torch.ops.aten._assert_scalar.default, (check, "size"))
    d = g.call_function(torch.ops.aten.mul.Tensor, (c, a))
    g.erase_node(g.call_function(torch.ops.aten.sin.default, (x,)))
    g.output((d,))
    a.prepend(b)
    if cycle:
        a.args = (d,)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_partitioning_reorders_the_graph_in_place_as_upstreams_copy_would(exir_patches,
                                                                         monkeypatch):
    """legalize_graph, run once per partition over the whole program, copies every node into a
    new graph and recompiles: the patch moves the graph's own nodes into the same order with the
    same users, inputs and names (a node added after gets the name it would), and recompiles
    nothing; a cycle still fails with upstream's error."""
    from executorch.exir import lowered_backend_module

    assert lowered_backend_module.legalize_graph is exir._UPSTREAM_LEGALIZE
    theirs, ours = unsorted_graph(), unsorted_graph()
    assert graph_state(theirs) == graph_state(ours)
    exir._UPSTREAM_LEGALIZE(theirs)
    recompiles = []
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: recompiles.append(1))
    exir_patches["legalize_in_place"].install()
    nodes = set(ours.graph.nodes)
    assert lowered_backend_module.legalize_graph(ours) is ours and not recompiles
    assert set(ours.graph.nodes) == nodes  # the same node objects, moved
    assert graph_state(ours) == graph_state(theirs)
    names = [n.name for n in ours.graph.nodes]
    assert names.index("relu_default") < names.index("neg_default")
    assert names.index("_assert_scalar_default") < names.index("add_tensor")  # prioritized
    for gm in (theirs, ours):  # a node made after: the same name in both
        with gm.graph.inserting_before(gm.graph.output_node()):
            gm.graph.call_function(torch.ops.aten.sin.default, (next(iter(gm.graph.nodes)),))
    assert graph_state(ours) == graph_state(theirs)
    for legalize in (exir._UPSTREAM_LEGALIZE, lowered_backend_module.legalize_graph):
        with pytest.raises(RuntimeError, match="Input graph has cycles"):
            legalize(unsorted_graph(cycle=True))


@pytest.mark.parametrize("doubled", [False, True])
def test_delegate_outputs_come_from_the_delegates_metadata(exir_patches, monkeypatch, doubled):
    """A retrace past the delegates (to_executorch's) makes each delegate's outputs from its
    program's metadata, as running the program gives them (symbolic tokens included), and runs
    no delegate program; an output size that is an expression (2 * tokens) runs upstream's. The
    bytes are upstream's either way."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    ep = traced(doubled)
    patch = exir_patches["delegate_fake_outputs"]
    runs, upstream = [], exir._UPSTREAM_CALL_DELEGATE
    monkeypatch.setattr(exir, "_UPSTREAM_CALL_DELEGATE",
                        lambda *a: runs.append(1) or upstream(*a))

    def lowered():
        runs.clear()
        edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
        return edge, edge.to_executorch().buffer

    edge, theirs = lowered()
    patch.install()
    _, ours = lowered()
    assert ours == theirs and len(runs) == (2 if doubled else 0)  # to_executorch's two
    gm = edge.exported_program().graph_module
    (call,) = [n for n in gm.graph.nodes if "call_delegate" in str(n.target)]
    module, *args = [getattr(gm, a.target) if a.op == "get_attr" else a.meta["val"]
                     for a in call.args]
    with args[0].fake_mode:
        made = exir._outputs_from_metadata(module.original_module, tuple(args))
        run = upstream(module, *args)
    if doubled:
        assert made is None and str(run[0].shape[0]) == f"2*{args[0].shape[0]}"
    else:
        describe = [(str(t.shape), t.stride(), t.dtype, type(t)) for t in run]
        assert [(str(t.shape), t.stride(), t.dtype, type(t)) for t in made] == describe
        assert str(made[0].shape[0]).startswith("s") and type(made) is type(run)


# --- torchao.hqq_in_blocks --------------------------------------------------------------------


@pytest.mark.parametrize("shape, group, dtype, bits, iters, tol", [
    ((64, 256), 32, torch.float32, 4, 20, 1e-5),  # converges early: the stop ends iterations
    ((64, 256), 32, torch.float32, 4, 20, 0.05),  # blocks cross the tolerance at different steps
    ((50, 384), 128, torch.float32, 4, 3, 1e-5),  # cut short, each block mid-way
    ((37, 96), 96, torch.bfloat16, 8, 20, 1e-5),  # per channel, 8-bit, bf16 scales back
    ((40, 64), 32, torch.float16, 4, 1, 1e-5)])
def test_hqq_in_blocks_gives_upstreams_scales_and_weights(monkeypatch, shape, group, dtype, bits,
                                                          iters, tol):
    """Blocks of three rows (a thirteen-block weight at most), a zero row (no least-squares
    solution: the previous scale stays) and a row on an exact grid: torchao's own function and
    the patch's return the same int32 weights and scales, bit for bit."""
    monkeypatch.setattr(torchao, "BLOCK_BYTES", 3 * 4 * shape[1])
    torch.manual_seed(bits * iters)
    w = torch.randn(shape)
    w[1] = 0
    w[2] = torch.randint(-(1 << bits - 1), 1 << bits - 1, (shape[1],)) * 0.01
    w = w.to(dtype)
    qmin, qmax = -(1 << bits - 1), (1 << bits - 1) - 1
    kw = dict(iters=iters, early_stop_tol=tol)
    expected = torchao._UPSTREAM(w, [1, group], qmin, qmax, **kw)
    got = torchao.hqq_in_blocks(w, [1, group], qmin, qmax, **kw)
    assert got[0].dtype == torch.int32 and got[1].dtype == dtype
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[1]._base is None  # not a view keeping every iteration's scales


def test_hqq_in_blocks_is_what_torchaos_quantization_calls(monkeypatch):
    """Installed, `quantize_` with edgellm's 8da4w config runs the patch, and the quantized linear
    holds upstream's weights and scales; restored, upstream's function runs again."""
    from torchao.quantization import quantize_

    from edgellm.quantize.recipes import torchao_config

    patch = by_name("torchao")["hqq_in_blocks"]
    calls, blocks = [], torchao.hqq_in_blocks
    monkeypatch.setattr(torchao, "hqq_in_blocks",
                        lambda w, *a, **k: calls.append(tuple(w.shape)) or blocks(w, *a, **k))
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 48, bias=False).requires_grad_(False)
    models = [torch.nn.Sequential(copy.deepcopy(linear)) for _ in range(2)]
    try:
        patch.install()
        quantize_(models[0], torchao_config(4, 32, dynamic=True))
        assert patch.installed() and calls == [(48, 256)]
        patch.restore()
        quantize_(models[1], torchao_config(4, 32, dynamic=True))
        assert calls == [(48, 256)]  # upstream's ran
    finally:
        patch.restore()
    assert not patch.installed()
    ours, theirs = (m[0].weight for m in models)
    assert torch.equal(ours.qdata, theirs.qdata) and torch.equal(ours.scale, theirs.scale)


def test_edgellms_quantize_runs_hqq_without_autograd(monkeypatch):
    """The model's float weights require grad (nn.Linear's default, as edgellm builds them):
    quantize runs without autograd, as torch.export does, so HQQ's twenty passes are not
    recorded (3 to 8 times slower on Phi-4-mini's linears when they were), installs the patch and
    reports it."""
    from torch import nn

    from edgellm.config import ExportConfig
    from edgellm.quantize import quantize

    grad_on, blocks = [], torchao.hqq_in_blocks
    monkeypatch.setattr(torchao, "hqq_in_blocks", lambda *a, **k: grad_on.append(
        torch.is_grad_enabled()) or blocks(*a, **k))
    model = nn.Module()
    model.embed_tokens, model.lm_head = nn.Embedding(100, 64), nn.Linear(64, 100)
    assert model.lm_head.weight.requires_grad
    try:
        done = quantize(model, ExportConfig(quantize="8da4w", group_size=32))
    finally:
        by_name("torchao")["hqq_in_blocks"].restore()
    assert grad_on == [False] and torch.is_grad_enabled()
    assert done.patches == {"torchao.hqq_in_blocks": "on"}

# --- coreml.* ---------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [
    np.float32(3.0), np.float32(70000.0), np.array([1e38, -np.inf, np.nan, 2.0], np.float32),
    np.array([[1.0, -65504.0], [0.5, 65504.0]], np.float32),
    np.array([[1.0, -65505.0]], np.float32), np.array([np.inf, 1e39], np.float32),
    np.concatenate([np.zeros(3 << 20, np.float32), [7e4]]),  # past the first chunks
    np.zeros((0, 4), np.float32)])
def test_fp16_range_check_answers_as_coremltools_does(coreml_patches, values):
    value = np.expand_dims(values, 0)  # coremltools 9.0's own test, verbatim
    abs_value = np.abs(value)
    upstream = np.max(abs_value[np.where(abs_value < 1e38)], initial=0.0) > 65504
    assert coreml.exceeds_fp16(values) == upstream


def test_the_copy_shares_every_weight_views_included(coreml_patches):
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.whole = torch.nn.Parameter(torch.randn(4, 4))
            self.view = torch.nn.Parameter(torch.randn(12, 4).chunk(3)[1])

        def forward(self, x):
            return x @ self.whole + x @ self.view

    ep = torch.export.export(Two(), (torch.randn(2, 4),))
    coreml_patches["shared_weights"].install()
    twin = CoreMLBackend.copy_exported_program_for_preprocess(ep, [])
    assert all(twin.state_dict[k] is ep.state_dict[k] for k in ("whole", "view"))
    assert twin.graph_module is not ep.graph_module


def test_mil_pipelines_validate_once_and_still_catch_a_broken_pass(coreml_patches, monkeypatch):
    """coremltools validates before a pipeline and after each pass; the patched pipeline once, after
    its last pass, with that pass's check. A pass that breaks the program still fails."""
    from coremltools.converters.mil.mil import Builder as mb
    from coremltools.converters.mil.mil import Program, types
    from coremltools.converters.mil.mil.block import InvalidBlockStateError
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.pass_pipeline import (PassPipeline,
                                                                       PassPipelineManager)
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3), dtype=types.fp32)])
    def prog(x):
        return mb.relu(x=mb.add(x=x, y=1.0))

    checks = []
    real = Program.validate
    monkeypatch.setattr(Program, "validate",
                        lambda self, check_essential_scope=False: checks.append(
                            check_essential_scope) or real(self, check_essential_scope))
    pipeline = PassPipeline.DEFAULT
    coreml_patches["validate_once"].install()
    PassPipelineManager.apply_pipeline(prog, pipeline)
    assert pipeline.passes[-1] == "common::dead_code_elimination" and checks == [True]
    coreml_patches["validate_once"].restore()
    PassPipelineManager.apply_pipeline(prog, pipeline)
    assert len(checks) == 2 + len(pipeline.passes)

    class BreakIt(AbstractGraphPass):  # relu's input forgets that relu consumes it
        def apply(self, program):
            relu = program.functions["main"].find_ops(op_type="relu")[0]
            relu.x._child_ops.remove(relu)

    monkeypatch.setitem(PASS_REGISTRY.passes, "test::break_it", BreakIt)
    broken = PassPipeline(pass_names=["test::break_it", "common::const_elimination"])
    coreml_patches["validate_once"].install()
    with pytest.raises(InvalidBlockStateError, match="should be consumed by op"):
        PassPipelineManager.apply_pipeline(prog, broken)


def test_integer_constants_deduplicate_exactly_without_float_copies(coreml_patches):
    """coremltools' constant deduplication finds the same duplicates with the patch (two equal
    int8 tables, a third equal in its hashed first values and not after; fp16 scales alike by
    its tolerance), and compares the tables in a tenth of upstream's memory (float64 copies)."""
    import importlib
    import tracemalloc

    from coremltools.converters.mil.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    dedup = importlib.import_module(
        "coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication")
    table = np.random.default_rng(0).integers(-128, 128, (4096, 576), dtype=np.int8)
    other = table.copy()
    other[-1, -1] ^= 1
    scales = np.linspace(1, 2, 4096, dtype=np.float16)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1,), dtype=types.fp32)])
    def prog(x):
        return [mb.identity(x=mb.const(val=v))
                for v in (table, table.copy(), other, scales, scales + np.float16(0))]

    def found(patched: bool):
        patch = coreml_patches["exact_dedup"]
        patch.install() if patched else patch.restore()
        tracemalloc.start()
        try:
            groups = dedup.const_deduplication.find_constants([prog.functions["main"]])
            return ({u.name: [d.name for d in dups] for u, dups in groups.items()},
                    tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
            patch.restore()

    (ours, our_peak), (theirs, their_peak) = found(True), found(False)
    assert ours == theirs and sorted(map(len, ours.values())) == [0, 1, 1]
    assert our_peak < table.nbytes * 2 < their_peak / 5, (our_peak, their_peak)


# --- vulkan.cached_patterns ----------------------------------------------------------------------


def test_vulkan_pattern_graphs_are_built_once_and_are_upstreams():
    """The registry's functions, cached: the same graphs (code) as upstream builds, the second
    time without building anything."""
    from executorch.backends.vulkan import patterns

    patch = by_name("vulkan")["cached_patterns"]
    patch.restore()
    upstream = [g.code for g in patterns.all_fusable_graph_patterns()]
    patch.install()
    try:
        first = patterns.all_fusable_graph_patterns()
        assert [g.code for g in first] == upstream and len(upstream) >= 3
        again = patterns.all_fusable_graph_patterns()
        assert all(a is b for a, b in zip(first, again))
    finally:
        patch.restore()
    assert not patch.installed()


# --- partition.lean_dependencies ------------------------------------------------------------------


def test_group_partitions_from_bit_masks_are_upstreams():
    """The group partitioner with each node's downstream nodes as a bit mask: the same downstream
    nodes as upstream's sets, and the same partitions, a merge that would make a cycle (through a
    node the backend does not take) refused as upstream refuses it; torch.fx's own viewer (both
    closures as sets), which upstream builds in its base class and throws away, is not built."""
    from executorch.exir.backend.canonical_partitioners import group_partitioner as groups
    from torch.fx.passes.operator_support import OperatorSupportBase

    from edgellm.patches import partition

    class Model(torch.nn.Module):
        def forward(self, x):
            a = x.sin()
            b = a.cos()  # not supported: sin and exp in one partition would loop through it
            c = (a + b).relu()
            d = c.exp() + b
            return d * a, c.tanh()

    class Supported(OperatorSupportBase):
        def is_node_supported(self, submodules, node):
            return node.op == "call_method" and node.target != "cos" or \
                node.op == "call_function"

    graph_module = torch.fx.symbolic_trace(Model())
    nodes = {n.name: n for n in graph_module.graph.nodes}
    upstream = partition._UPSTREAM_VIEWER(graph_module)
    ours = partition._Downstreams(graph_module)
    assert all(ours.downstreams_of(n) == upstream.downstreams_of(n) for n in nodes.values())

    fx_viewers = []
    fx_viewer = partition._FX._DependencyViewer

    def counted(graph_module):
        fx_viewers.append(graph_module)
        return fx_viewer(graph_module)

    def partitions(patched: bool) -> list:
        patch = partition.PATCHES[0]
        patch.install() if patched else patch.restore()
        partition._FX._DependencyViewer = counted
        try:
            found = groups.GroupBasedPartitioner(
                graph_module, Supported(), allows_single_node_partition=True,
                node_groups=[[nodes["add"], nodes["relu"]]],
            ).propose_partitions()
        finally:
            patch.restore()
            partition._FX._DependencyViewer = fx_viewer
        return sorted(sorted(n.name for n in p.nodes) for p in found)

    found = partitions(True)
    assert fx_viewers == []
    assert found == partitions(False)
    assert fx_viewers == [graph_module]  # upstream builds it
    assert ["sin"] in found  # merged with the rest, it would loop through cos


def test_an_export_takes_its_patches_off_when_it_returns_or_fails(tiny_models, tmp_path,
                                                                   monkeypatch):
    """Patches last as long as an export: after `edgellm.export` returns, and after one that
    fails once they are installed, every upstream function is the original again (each pinned name resolves to
    what it did before); a second export in the same process installs them again and writes
    the same bytes."""
    import edgellm.pipeline

    every = patches.everything()
    for p in every:  # what tests before this one in the process left installed
        if p.installed():
            p.restore()
    upstream = {pin: patches.resolve(pin) for p in every for pin in p.pins}

    def export(name):
        return edgellm.export(tiny_models["llama"][0], output=tmp_path / name, verify=False,
                              backends="xnnpack", quiet=True, etrecord=False, **SIZES)

    first = export("one")
    assert [n for n, why in first["patches"].items() if why == "on"]  # they were on meanwhile
    from edgellm.patches import private

    assert set(first["private_upstream"].values()) == {"pinned"}
    assert set(first["private_upstream"]) == {next(iter(p.pins)) for p in private.PINS}
    assert not [p.name for p in every if p.installed()]
    assert {pin: patches.resolve(pin) for pin in upstream} == upstream
    assert export("two")["patches"] == first["patches"]
    assert (tmp_path / "two" / "model.pte").read_bytes() == \
        (tmp_path / "one" / "model.pte").read_bytes()

    def broken(*args, **kwargs):  # after the lowering patches are installed
        raise RuntimeError("out of memory")

    monkeypatch.setattr(edgellm.pipeline, "capture", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        export("three")
    assert not [p.name for p in every if p.installed()]
    assert not (tmp_path / "three").exists()


def test_every_private_upstream_name_edgellm_calls_is_pinned():
    """Outside patches/, each private name of torch, ExecuTorch, coremltools, torchao, gguf or
    transformers that edgellm's code spells (an import, or an attribute it does not define
    itself) is one a `patches.private` pin declares, and every pin matches what is installed
    here; an export reports them (report.json's `private_upstream`)."""
    import ast
    from pathlib import Path

    from edgellm.patches import private

    root = Path(edgellm.__file__).parent
    upstream = ("torch", "executorch", "coremltools", "torchao", "gguf", "transformers")
    ours, spelled = set(), {}

    def private_part(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for path in root.rglob("*.py"):
        if "patches" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    ast.unparse(node.value) in ("self", "cls"):
                ours.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in upstream:
                for part in node.module.split(".") + [a.name for a in node.names]:
                    if private_part(part):
                        spelled.setdefault(part, where)
            elif isinstance(node, ast.Attribute) and private_part(node.attr):
                spelled.setdefault(node.attr, where)
    declared = {name for pin in private.PINS for name in pin.uses}
    assert {n: w for n, w in spelled.items() if n not in ours and n not in declared} == {}
    assert not [n for n in declared if private_part(n) and n not in spelled], "a pin unused"
    assert all(v == "pinned" for v in private.status().values()), private.status()
