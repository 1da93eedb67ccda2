"""Mixture-of-experts (architectures/moe.py, quantize/experts.py): float experts gathered per
token climb the families' parity ladder (test_families.py, conftest.FAMILIES); here, the 4- and
8-bit experts ExecuTorch's `llama::quantized_moe_ffn` runs from torchao-packed blobs, the other
formulations of a recipe (`--experts chosen`: a delegate per expert behind a torch.cond;
`--experts every`), the programs that carry them, what a token reads, and what is refused."""

import pytest
import torch

from conftest import LONG, assert_logits_close
from edgellm.architectures.moe import Routing, SparseMoE
from edgellm.cli import main
from edgellm.quantize.experts import pack_experts, symmetric

ROUTINGS = {  # LFM2-MoE's and Qwen3-MoE's, and each with the other's normalisation
    "sigmoid-bias": Routing("sigmoid", 8, 3, True, 2.5, eps=1e-6, bias=True),
    "sigmoid-raw": Routing("sigmoid", 8, 3, False, 1.5, bias=True),
    "softmax-raw": Routing("softmax", 8, 3, False),
    "softmax-normalised": Routing("softmax", 8, 3, True),
}


def random_block(routing: Routing, hidden=64, width=128, seed=0) -> SparseMoE:
    g = torch.Generator().manual_seed(seed)
    block = SparseMoE(routing, hidden, width)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() == 1 else 0.3))
    return block.eval()


def on_grid(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Stacked expert matrices replaced by the values their quantization stands for."""
    out = []
    for m in w:
        q, s = symmetric(m, bits, group)
        out.append((q.float().view(m.shape[0], -1, group) * s[..., None]).view(m.shape))
    return torch.stack(out)


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
def test_packed_experts_in_the_op_equal_the_float_experts_on_their_grid(name, bits, group):
    """The op with our blobs computes what the gathered float formulation computes on the
    quantized values: the layout, the routing contract (bias for the choice only, the op's
    normalisation undone where the model does not normalise) and the scale all agree."""
    block = random_block(ROUTINGS[name])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        w13, w2 = block.experts.gate_up_proj.clone(), block.experts.down_proj.clone()
        block.experts.gate_up_proj.copy_(on_grid(w13, bits, group))
        block.experts.down_proj.copy_(on_grid(w2, bits, group))
        expected = block(x)
        block.use_packed(pack_experts(w13, bits, group), pack_experts(w2, bits, group), bits,
                         group)
        for rows in (x, x[:1]):  # a prompt's tokens, and a decode step
            actual = block(rows)
            scale = expected[:len(rows)].abs().max()
            assert (actual - expected[:len(rows)]).abs().max() <= 1e-5 * scale, name


def test_a_wrong_layout_does_not_pass_for_the_right_one():
    """The comparison above has teeth: the experts' blobs one expert out of place change it."""
    block = random_block(ROUTINGS["softmax-normalised"])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x)
        w13 = pack_experts(block.experts.gate_up_proj, 8, 32)
        block.use_packed(w13.roll(1, dims=0), pack_experts(block.experts.down_proj, 8, 32), 8, 32)
        assert (block(x) - expected).abs().max() > 0.1 * expected.abs().max()


@pytest.fixture(scope="module")
def quantized(exported):
    # verification's bounds are a real model's: a tiny random one's routers flip under 8da4w
    return exported("lfm2_moe", quantize="8da4w", group_size=32, experts="op", verify=False,
                    etrecord=False, **LONG)


def follows_its_eager_model(folder, tiny_models, min_sqnr_db=None, **options) -> None:
    """The program at `folder` against its eager model (made as the export made it), both fed
    the eager model's greedy tokens, a prompt then a token per call: the same greedy token at
    every step, or (`min_sqnr_db`: XNNPACK's 8-bit activations round apart from torchao's eager
    reference, and a tiny random model's flat logits flip) logits within that SQNR."""
    from edgellm.config import ExportConfig
    from edgellm.backends import plan_for
    from edgellm.eager import eager_model
    from edgellm.progress import Stages
    from edgellm.program import Program

    cfg = ExportConfig(model=tiny_models["lfm2_moe"][0], **options, **LONG)
    model = eager_model(cfg, plan_for(cfg), Stages(quiet=True)).model
    program = Program(folder / "model.pte")
    ids, pos, wants, gots = [5, 17, 42, 99, 3, 64, 128], 0, [], []
    with torch.no_grad():
        for _ in range(8):
            step = torch.tensor([ids[pos:]])
            wants.append(model(step, torch.tensor([pos]))[0])
            gots.append(program.forward(step, torch.tensor([pos]))[0])
            pos = len(ids)
            ids.append(int(wants[-1].argmax()))
    want, got = torch.stack(wants), torch.stack(gots)
    if min_sqnr_db is None:
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:
        sqnr = 10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum())
        assert sqnr >= min_sqnr_db, f"{sqnr:.1f} dB"


def test_4bit_program_runs_the_chosen_experts_in_executorchs_op(quantized, tiny_models):
    """An 8da4w export: the attention, conv and dense layers in XNNPACK, each sparse block one
    `llama::quantized_moe_ffn` beside them; the program follows its eager model (the same
    blobs through the op's ATen kernel) greedily, a prompt then a token per call."""
    folder, report = quantized
    assert report["quantization"]["expert_blocks_packed"] == 2  # layers 1 and 2 of 3
    assert report["quantization"]["experts"] == "op"
    ops = report["methods"]["forward"]["delegation"]["by_op"]
    assert ops["llama_quantized_moe_ffn_default"] == {"delegated": 0, "non_delegated": 2}
    follows_its_eager_model(folder, tiny_models, quantize="8da4w", group_size=32, experts="op")


@pytest.mark.parametrize("name", ROUTINGS)
def test_every_expert_as_two_linears_is_the_gathered_sum(name):
    """`--experts every`: every expert computed by two linears, the hidden scaled by the routing
    weights (zero where not chosen), equals the chosen experts' sum in float."""
    from edgellm.architectures.moe import every_expert_linears

    block = random_block(ROUTINGS[name])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x)
        block.use_linears(*every_expert_linears(block))
        assert (block(x) - expected).abs().max() <= 1e-6 * expected.abs().max(), name


def test_every_expert_program_delegates_the_experts_to_xnnpack(exported, tiny_models):
    """`--experts every` with 8da4w: each block's two expert linears are XNNPACK's (no
    llama::quantized_moe_ffn), a token counts every expert as read, and the program follows its
    eager model (within XNNPACK's activation rounding)."""
    folder, report = exported("lfm2_moe", quantize="8da4w", group_size=32, experts="every",
                              verify=False, etrecord=False, **LONG)
    assert report["quantization"]["experts"] == "every"
    assert report["parameters"]["per_token"] == report["parameters"]["total"]
    ops = report["methods"]["forward"]["delegation"]["by_op"]
    assert "llama_quantized_moe_ffn_default" not in ops
    assert ops["aten_topk_default"]["non_delegated"] == 2  # routing stays on the CPU
    q = report["quantization"]  # a regridded linear's offsets are one more quantized linear
    linears = q["linears_quantized"] + q.get("linears_regridded", 0)  # and 2 per sparse block
    assert ops["torchao_quantize_affine_default"] == {"delegated": linears + 4, "non_delegated": 0}
    assert ops["aten_linear_default"]["non_delegated"] == 0
    follows_its_eager_model(folder, tiny_models, min_sqnr_db=15, quantize="8da4w",
                            group_size=32, experts="every")


@pytest.mark.parametrize("name", ROUTINGS)
def test_an_expert_apiece_run_when_chosen_is_the_gathered_sum(name):
    """`--experts chosen` eager: each expert a module of its own, run only on a call where a
    token chose it, scaled by the routing weights (zero where not chosen), equals the gathered
    sum in float; an expert no token chose is not run."""
    from edgellm.architectures.moe import Expert

    block = random_block(ROUTINGS[name])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, (_, idx) = block(x), block.route(x[:1])
        block.use_each(torch.nn.ModuleList(Expert.of(a, b) for a, b in zip(
            block.experts.gate_up_proj, block.experts.down_proj)))
        assert (block(x) - expected).abs().max() <= 1e-6 * expected.abs().max(), name
        ran = set()
        for e, expert in enumerate(block.each):
            expert.register_forward_hook(lambda *_, e=e: ran.add(e))
        block(x[:1])
        assert ran == set(idx[0].tolist())


def test_chosen_experts_refused_when_the_partitioners_leave_an_expert_outside():
    """lower_experts needs each expert whole in one delegate: with partitioners that take
    nothing, it says so and names what was left outside, rather than build a program that
    runs an expert's ops outside any delegate behind the cond."""
    from edgellm.architectures.moe import Expert
    from edgellm.lower import lower_experts

    block = random_block(ROUTINGS["sigmoid-bias"])
    block.use_each(torch.nn.ModuleList(Expert.of(a, b) for a, b in zip(
        block.experts.gate_up_proj, block.experts.down_proj)))
    with pytest.raises(RuntimeError, match=r"did not take the expert whole, from \(x, w\), in "
                       r"one delegate \(left outside: \['aten\.mm\.default', .*"
                       r"'aten\.sigmoid\.default'\], delegates: 0\)"):
        lower_experts(block, lambda: [], max_tokens=4)


def test_each_expert_is_lowered_to_a_delegate_without_a_deprecation_warning(caplog):
    """lower_experts lowers each expert from one edge program (to_edge_transform_and_lower's
    first step) through to_backend: a delegate apiece, and no warning of the deprecated
    to_edge + to_backend split, which this is not (XNNPACK's partitioner would log one per
    expert)."""
    from edgellm.architectures.moe import Expert
    from edgellm.backends import get_backend
    from edgellm.lower import lower_experts

    block = random_block(ROUTINGS["sigmoid-bias"])
    block.use_each(torch.nn.ModuleList(Expert.of(a, b) for a, b in zip(
        block.experts.gate_up_proj, block.experts.down_proj)))
    xnnpack = get_backend("xnnpack")
    with caplog.at_level("WARNING"):
        assert lower_experts(block, lambda: xnnpack.make_partitioners(xnnpack.options()),
                             max_tokens=4) == 8
    assert len(block.delegates) == 8
    assert not [r for r in caplog.records if "to_backend()" in r.getMessage()]


def test_chosen_experts_program_branches_to_a_delegate_apiece(exported, tiny_models):
    """8da4w with the experts as the default (auto) runs them, `--experts chosen`: each expert
    of the 2 sparse blocks is an XNNPACK delegate of its own behind a torch.cond on whether a
    token chose it (8 conds per block, no llama::quantized_moe_ffn); report.json counts their
    linears as XNNPACK's and a token as reading its chosen experts; the program follows its
    eager model (within XNNPACK's activation rounding), a prompt then a token per call."""
    folder, report = exported("lfm2_moe", quantize="8da4w", group_size=32, verify=False,
                              etrecord=False, **LONG)
    assert report["quantization"]["experts"] == "chosen"
    unread = 2 * (8 - 2) * 3 * 32 * 64
    assert report["parameters"]["total"] - report["parameters"]["per_token"] == unread
    d = report["methods"]["forward"]["delegation"]
    assert "llama_quantized_moe_ffn_default" not in d["by_op"]
    assert d["by_op"]["cond"] == {"delegated": 0, "non_delegated": 16}
    xnnpack = d["by_backend"]["XnnpackBackend"]
    assert xnnpack["subgraphs"] == d["subgraphs"] + 16  # the experts' are inside the branches
    q = report["quantization"]  # a regridded linear's offsets are one more quantized linear
    linears = q["linears_quantized"] + q.get("linears_regridded", 0)  # and each expert's 3
    assert xnnpack["ops"]["torchao.quantize_affine.default"] == linears + 48
    follows_its_eager_model(folder, tiny_models, min_sqnr_db=15, quantize="8da4w",
                            group_size=32, experts="chosen")


def test_a_token_reads_its_chosen_experts_only(quantized, tiny_models):
    """report.json: the parameters a token reads leave out the experts it did not choose (2
    sparse blocks of 8 experts of 3 x 32 x 64, 2 chosen), and so do the bytes: packing the
    experts saves a decode step the float bytes of its 2 chosen experts less 2/8 of the 8 packed
    blobs, each blob's size from torchao's layout (a 64-byte header; per row, K/2 bytes of 4-bit
    values and a float32 scale and int32 sum per group of 32)."""
    from edgellm.architectures import build_model
    from edgellm.architectures.layers import ModelOptions, weight_bytes
    from edgellm.quantize.experts import quantize_experts
    from edgellm.sources import load_source

    _, report = quantized
    unread = 2 * (8 - 2) * 3 * 32 * 64
    assert report["parameters"]["total"] - report["parameters"]["per_token"] == unread
    source = load_source(str(tiny_models["lfm2_moe"][0]))
    model = build_model(source.hf_config, source.state_dict, ModelOptions(48), torch.float32)
    before = weight_bytes(model)
    blocks, saved = quantize_experts(model, 4, 32)

    def blob(rows, k):
        return 64 + rows * (k // 2 + 8 * k // 32)

    packed = 8 * (blob(64, 64) + blob(64, 32))  # gate_up (2F=64, D=64), down (D=64, F=32)
    expected = 2 * (2 * 3 * 32 * 64 * 4 - packed * 2 // 8)
    assert blocks == 2 and saved == expected and before - weight_bytes(model) == expected


@pytest.mark.parametrize("group, why", [
    (64, "group_size 64 does not divide the expert width 32"),
    (0, "per-channel"),
])
def test_experts_the_op_cannot_take_are_refused(tiny_models, tmp_path, capsys, group, why):
    folder = tiny_models["lfm2_moe"][0]
    code = main(["export", str(folder), "-o", str(tmp_path / "o"), "--quantize", "8da4w",
                 "--group-size", str(group), "--experts", "op", "--max-seq-len", "16",
                 "--max-context-len", "48", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "llama::quantized_moe_ffn" in err and why in err, err
    assert not (tmp_path / "o").exists()  # refused before anything was written


@pytest.mark.parametrize("formulation", ["chosen", "every"])
def test_a_formulation_of_quantized_experts_without_a_recipe_is_refused(tiny_models, tmp_path,
                                                                        capsys, formulation):
    """`--experts chosen|every` says how a recipe's experts run: without one the experts stay
    float and gathered, so the flag would do nothing, and is refused saying so."""
    code = main(["export", str(tiny_models["lfm2_moe"][0]), "-o", str(tmp_path / "o"),
                 "--experts", formulation, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"experts: '{formulation}' is how a recipe's experts run" in err, err
    assert not (tmp_path / "o").exists()


def test_coreml_takes_float_experts_whole_and_refuses_quantized_ones(exported, tiny_models,
                                                                     tmp_path, capsys):
    """Float experts gathered per token: the router's top-k, the gathers and the experts all
    inside Core ML's one delegate. Quantized ones would be dequantized whole or leave Core ML at
    every layer: refused with the reason, before anything is written."""
    _, report = exported("lfm2_moe", backends="coreml", verify=False, etrecord=False, **LONG)
    d = report["methods"]["forward"]["delegation"]
    assert d["subgraphs"] == 1 and d["non_delegated_compute_nodes"] == 0
    code = main(["export", str(tiny_models["lfm2_moe"][0]), "-o", str(tmp_path / "o"),
                 "--backend", "coreml", "--quantize", "4w", "--group-size", "32",
                 "--max-seq-len", "16", "--max-context-len", "48", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "mixture-of-experts layers on coreml" in err
    assert "dequantizes whole" in err and not (tmp_path / "o").exists()


def test_float_expert_program_matches_transformers(exported, tiny_models):
    """The XNNPACK program with float experts (the gathers and top-k in ExecuTorch's kernels,
    the matmuls delegated) against transformers: a prompt, ten tokens a call each, 16 in one
    call, then one (Qwen3-MoE's unnormalised softmax weights, a dense layer between)."""
    from test_families import ladder_run, transformers_run

    from edgellm.program import Program

    prompt = [int(x) for x in torch.randint(2, 160, (12,),
                                            generator=torch.Generator().manual_seed(0))]
    tokens, expected = transformers_run(tiny_models["qwen3_moe"][1], prompt)
    folder, _ = exported("qwen3_moe", verify=False, etrecord=False, **LONG)
    rows, actual = ladder_run(Program(folder / "model.pte").forward, prompt, tokens)
    assert_logits_close(actual, expected[rows], atol=1e-4, what="qwen3_moe program")


def test_a_folder_missing_an_expert_is_refused_by_name(tiny_models, tmp_path):
    """The folder's one tensor per expert is stacked when it is read; one missing is named."""
    import shutil

    from safetensors.torch import load_file, save_file

    from edgellm.errors import InputError
    from edgellm.sources import load_source

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"][0], folder)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"lacks model\.layers\.2\.mlp\.experts\.5\.up_proj"
                                         r"\.weight: the config has 8 experts per layer"):
        load_source(str(folder))


def test_a_recipe_reads_the_experts_one_block_at_a_time(tiny_models, monkeypatch):
    """Streaming export: with a recipe, the build leaves the experts in the checkpoint (meta
    Parameters of their shape and dtype, so report.json counts them as loaded) and quantization
    reads each expert's matrices as it packs them, a block's before the next block's. The
    blobs are those of experts loaded whole, and the float model a verification needs reads
    them all back, equal to a build without deferral."""
    from edgellm.architectures import build_model, load_deferred
    from edgellm.architectures.layers import ModelOptions, weight_bytes
    from edgellm.architectures.moe import Deferred
    from edgellm.quantize.experts import quantize_experts
    from edgellm.sources import load_source

    def model(defer):
        source = load_source(str(tiny_models["qwen3_moe"][0]))
        return build_model(source.hf_config, source.state_dict, ModelOptions(48), torch.float32,
                           defer=defer)

    whole, deferred = model(False), model(True)
    blocks = [m for m in deferred.modules() if isinstance(m, SparseMoE)]
    assert all(b.experts.gate_up_proj.is_meta and b.experts.down_proj.is_meta for b in blocks)
    assert weight_bytes(deferred) == weight_bytes(whole)
    events, read, packed = [], Deferred.__getitem__, SparseMoE.use_packed
    monkeypatch.setattr(Deferred, "__getitem__", lambda self, e: events.append("read") or read(
        self, e))
    monkeypatch.setattr(SparseMoE, "use_packed", lambda self, *a: events.append("pack") or packed(
        self, *a))
    quantize_experts(whole, 4, 32)
    assert events == ["pack"] * len(blocks)  # experts loaded whole: nothing read
    events.clear()
    quantize_experts(deferred, 4, 32)
    assert events == (["read"] * 2 * 8 + ["pack"]) * len(blocks)  # an expert at a time
    for a, b in zip(whole.modules(), deferred.modules()):
        if isinstance(a, SparseMoE):
            assert torch.equal(a.packed_w13, b.packed_w13) and torch.equal(a.packed_w2,
                                                                           b.packed_w2)
    again, whole = model(True), model(False)
    load_deferred(again)
    assert all(torch.equal(p, q) for p, q in zip(whole.state_dict().values(),
                                                  again.state_dict().values()))
    with pytest.raises(RuntimeError, match="still in the checkpoint"):
        model(True)(torch.tensor([[1, 2]]), torch.tensor([0]))


def test_a_verification_the_machine_cannot_hold_is_refused_before_any_work(
        tiny_models, tmp_path, capsys, monkeypatch):
    """transformers' fp32 model and edgellm's float model side by side, 8 bytes a parameter:
    past the memory available, the export stops at once and says to pass --no-verify."""
    import edgellm.memory

    monkeypatch.setattr(edgellm.memory, "available_bytes", lambda: 1 << 20)
    code = main(["export", str(tiny_models["qwen3_moe"][0]), "-o", str(tmp_path / "o"),
                 "--quantize", "8da4w", "--group-size", "32", "--max-seq-len", "16",
                 "--max-context-len", "48", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "this machine has 1.00 MB available. Export with --no-verify" in err, err
    assert "Verification holds transformers' fp32 model" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("arch, backend", [("lfm2_moe", "portable"), ("qwen3_moe", "vulkan")])
def test_float_experts_lower_and_verify_on_portable_and_vulkan(exported, arch, backend):
    """Float experts on the other two backends, verified as every export is: the portable
    program run here, a prompt then a token per call, against transformers (fp32 bounds); the
    Vulkan program's exported graph (its delegates do not run here), with the linears delegated
    and the gathers and top-k left to ExecuTorch's CPU kernels."""
    _, report = exported(arch, backends=backend, etrecord=False, **LONG)
    checks = {c["level"]: c for c in report["verify"]["checks"]}
    assert report["verify"]["passed"] and checks["rewrite"]["min_sqnr_db"] == 60.0
    level = "program" if backend == "portable" else "exported graph"
    assert checks[level]["passed"] and checks[level]["top1"] == 1.0
    d = report["methods"]["forward"]["delegation"]
    assert (d["subgraphs"] > 0) == (backend == "vulkan")
    if backend == "vulkan":  # 2 sparse blocks' top-k, and their expert gathers, on the CPU
        ops = d["by_op"]
        assert ops["aten_topk_default"]["non_delegated"] == 2
        assert ops["aten_index_tensor"]["non_delegated"] >= 4
