"""--external-weights: model.pte keeps no weights, foundation.ptd holds them, a tied table and its
head once; every runtime finds the file beside the program."""

import shutil

import pytest
import torch

import edgellm
from edgellm.errors import ConfigError, InputError
from edgellm.program import Program

from conftest import cached_run, reference_run

# from float weights at llama.cpp's block, the tied head takes 8 bits per channel, as the table
SHARED = dict(quantize="8da4w", group_size=32, embedding_quantize="8")


def test_the_weights_go_to_foundation_ptd_and_a_tied_table_is_stored_once(exported, tiny_models):
    """Beside a one-file export of the same recipe, model.pte holds no weights and the two files
    together are smaller by the table's 8-bit codes: the head's and the table's are one buffer.
    The program still agrees with transformers (the export verified it) and gives its greedy
    tokens through edgellm's runtime, which finds foundation.ptd beside model.pte."""
    one, one_report = exported("qwen2", **SHARED)
    two, report = exported("qwen2", external_weights=True, **SHARED)
    assert report["verify"]["passed"]
    assert report["files"]["weights"] == "foundation.ptd"
    sizes = {p.name: p.stat().st_size for p in two.iterdir() if p.suffix in (".pte", ".ptd")}
    assert report["file_bytes"] == sizes and report["pte_bytes"] == sum(sizes.values())
    assert report["quantization"]["embeddings"] == "8"
    hf = tiny_models["qwen2"][1]
    codes = hf.config.vocab_size * hf.config.hidden_size  # the table's int8 codes
    assert kept_bytes(two / "model.pte") < 16  # a lifted scalar at most
    # less a few bytes per tensor of foundation.ptd's index and alignment
    assert one_report["pte_bytes"] - report["pte_bytes"] >= 0.8 * codes
    prompt = list(range(2, 10))
    tokens, _ = reference_run(hf, prompt, steps=6)
    program = Program(two / "model.pte")
    assert program.data == two / "foundation.ptd"
    assert [int(t) for t in cached_run(program.forward, prompt, tokens).argmax(-1)] == tokens


def kept_bytes(pte) -> int:
    """Bytes of constants and named data (delegates' weights) a .pte holds itself."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(pte.read_bytes())
    named = pte.named_data
    return (sum(len(b.storage) for b in pte.program.constant_buffer)
            + (sum(len(b) for b in named.buffers) if named else 0))


def test_text_llm_runner_takes_the_program_with_its_data_path(exported):
    """ExecuTorch's own runner, given foundation.ptd as its data_path, generates what it does
    from the one-file program of the same recipe (the tiny tokenizer reads differently in C++:
    the runner is compared with itself)."""
    import executorch.kernels.quantized  # noqa: F401  embedding_byte, before the runner loads
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    texts = []
    for folder, data in ((exported("qwen2", **SHARED)[0], None),
                         (exported("qwen2", external_weights=True, **SHARED)[0],
                          "foundation.ptd")):
        pieces = []
        runner = TextLLMRunner(str(folder / "model.pte"), str(folder / "tokenizer.json"),
                               str(folder / data) if data else None)
        runner.generate("the quick brown fox", GenerationConfig(
            max_new_tokens=6, temperature=0.0, echo=False, warming=False),
            token_callback=pieces.append)
        texts.append(pieces)
    assert len(texts[0]) == 6 and texts[1] == texts[0]


def test_a_float_program_stores_a_tied_table_once_too(exported, tiny_models):
    """fp32: XNNPACK's head and the program's table are the same float bytes."""
    _, one = exported("qwen2", verify=False, etrecord=False)
    _, two = exported("qwen2", verify=False, etrecord=False, external_weights=True)
    hf = tiny_models["qwen2"][1]
    table = hf.config.vocab_size * hf.config.hidden_size * 4
    assert one["pte_bytes"] - two["pte_bytes"] >= 0.9 * table


def test_a_missing_or_cut_data_file_is_one_clear_error(exported, tmp_path):
    folder, _ = exported("qwen2", external_weights=True, **SHARED)
    shutil.copy(folder / "model.pte", tmp_path / "model.pte")
    with pytest.raises(InputError, match="needs its foundation.ptd beside it, and there is none"):
        Program(tmp_path / "model.pte")
    data = (folder / "foundation.ptd").read_bytes()
    (tmp_path / "foundation.ptd").write_bytes(data[:len(data) // 2])
    with pytest.raises(InputError, match="foundation.ptd may be damaged or another program's"):
        Program(tmp_path / "model.pte")


@pytest.mark.parametrize("backends, why", [
    ("coreml", "inside the compiled Core ML model"),
    ("vulkan", "Vulkan delegate keeps its weights in its own payload")])
def test_backends_that_keep_weights_in_their_payload_refuse_it(backends, why, tmp_path):
    with pytest.raises(ConfigError, match=f"external_weights on {backends}: .*{why}"):
        edgellm.export(output=tmp_path / "out", backends=backends, external_weights=True)


def test_export_llm_s_foundation_weights_file_sets_it():
    from edgellm.etconfig import translate

    assert translate({"export": {"foundation_weights_file": "foundation.ptd"}})[
        "external_weights"] is True
    with pytest.raises(ConfigError, match="writes the weights to foundation.ptd beside model.pte"):
        translate({"export": {"foundation_weights_file": "weights.ptd"}})


def test_a_tied_table_takes_its_head_s_codes_only_for_a_data_file():
    """The plan gives the table the head's codes (one buffer in foundation.ptd) only with
    external weights; a one-file program keeps the table's own min/max scales."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_qwen2_config
    from edgellm.architectures.layers import separate_tied_head
    from edgellm.config import ExportConfig
    from edgellm.quantize.plan import plan

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(96))
    model.lm_head = None
    separate_tied_head(model)
    cfg = ExportConfig(**SHARED)
    assert not plan(model, cfg).table_from_head
    assert plan(model, ExportConfig(**SHARED, external_weights=True)).table_from_head
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_a_one_file_program_holding_a_tied_table_twice_says_what_would_store_it_once():
    from types import SimpleNamespace

    from edgellm.backends import get_backend
    from edgellm.config import ExportConfig
    from edgellm.pipeline import stored_twice

    def twice(backend, tied=True, **options):
        plan = SimpleNamespace(backends=[get_backend(backend)])
        source = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=tied))
        return stored_twice(ExportConfig(**options), plan, source)

    assert twice("xnnpack")
    assert not twice("xnnpack", external_weights=True)
    assert not twice("xnnpack", tied=False)
    assert not twice("coreml") and not twice("portable")  # the head is the table there
