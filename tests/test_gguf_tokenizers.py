"""Tokenizers as llama.cpp stores them: tests/data/gguf_tokenizers holds vocabulary-only GGUF
files of every tokenizer the GGUF families carry (byte-level BPE under each pre-tokenizer name
llama.cpp's converter writes for them; SentencePiece with byte fallback as TinyLlama, Phi-3 and
Gemma 3 store it, Gemma's at its 262,144 tokens), with the ids llama.cpp itself gives on them
(bench/gguf_tokenizers.py wrote both; manifest.json says with which llama.cpp). edgellm's
tokenizer of each file gives llama.cpp's ids for the shipped text and a sample of code, numbers,
emoji, CJK and Arabic, adds BOS where llama.cpp does, stops where llama.cpp stops, and ships the
file's chat template, through which `edgellm chat` and `serve` build llama.cpp's chat prompt."""

import functools
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgellm.errors import InputError
from edgellm.sources import load_source
from edgellm.sources.gguf import tokenizer_of
from edgellm.sources.gguf_tokenizer import PRE_TOKENIZERS

FIXTURES = Path(__file__).parent / "data" / "gguf_tokenizers"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
FILES = sorted(MANIFEST["files"])
TEXT = Path(__file__).parents[1] / MANIFEST["texts"]["perplexity"]["path"]
TEXTS = {"perplexity": TEXT.read_text(), "sample": MANIFEST["texts"]["sample"]}


@functools.cache
def built(name: str, out: Path):
    """edgellm's tokenizer of the file, the folder an export writes the tokenizer into, and the
    file's number of tokens and chat template (read by the reader the tokenizer was read with)."""
    from edgellm.sources.gguf import _reader

    tokens = tokenizer_of(FIXTURES / name)
    fields = _reader(FIXTURES / name).fields
    out.mkdir(parents=True, exist_ok=True)
    assert tokens.write(out)
    return SimpleNamespace(tokens=tokens, folder=out,
                           count=len(fields["tokenizer.ggml.tokens"].data),
                           template=fields["tokenizer.chat_template"].contents())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return lambda name: built(name, root / name)


def first_difference(ours: list, theirs: list, tokenizer) -> str:
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b),
             min(len(ours), len(theirs)))
    spell = lambda ids: [(t, tokenizer.id_to_token(t)) for t in ids[i:i + 3]]  # noqa: E731
    return f"first difference at {i}: llama.cpp {spell(theirs)}, edgellm {spell(ours)}"


def test_the_fixtures_hold_every_tokenizer_the_gguf_families_carry(files):
    """Every family edgellm reads from GGUF has its tokenizers here, every BPE file's
    pre-tokenizer is one edgellm knows, Gemma's vocabulary is its full size, and the ids were
    taken on the text edgellm ships now."""
    from edgellm.architectures.registry import every

    held = MANIFEST["files"]
    readable = {a.gguf.arch for a in every() if a.gguf is not None}
    assert {family for f in held.values() for family in f["families"]} == readable
    assert {f["pre"] for f in held.values() if f["tokenizer"] == "gpt2"} <= set(PRE_TOKENIZERS)
    assert {f["tokenizer"] for f in held.values()} == {"gpt2", "llama"}
    assert files("gemma3-spm.gguf").count == 262144
    assert hashlib.sha256(TEXT.read_bytes()).hexdigest() == \
        MANIFEST["texts"]["perplexity"]["sha256"], "run bench/gguf_tokenizers.py again"


@pytest.mark.parametrize("name", FILES)
def test_a_gguf_tokenizes_as_llamacpp_does(name, files):
    """For the shipped text and the sample, with and without BOS: the tokenizer edgellm builds
    from the file, and the tokenizer.json an export writes beside the program (what `edgellm
    generate` reads), give llama.cpp's ids; BOS, whether it is added, and the stops are
    llama.cpp's; the tokenizer holds the file's tokens and no others."""
    from tokenizers import Tokenizer

    file, expected = files(name), MANIFEST["files"][name]["llama_cpp"]
    ours = file.tokens.tokenizer()
    written = Tokenizer.from_file(str(file.folder / "tokenizer.json"))
    for text_name, text in TEXTS.items():
        for mode, special in (("plain", False), ("bos", True)):
            theirs = expected["ids"][text_name][mode]
            for tokenizer in (ours, written):
                ids = tokenizer.encode(text, add_special_tokens=special).ids
                assert ids == theirs, f"{name} {text_name} {mode}: " + first_difference(
                    ids, theirs, tokenizer)
    tokens = file.tokens
    assert (tokens.bos_id, tokens.settings.add_bos) == (expected["bos"], expected["add_bos"])
    assert tokens.eos_ids[0] == expected["eos"] and set(tokens.eos_ids) == set(expected["eog"])
    assert ours.get_vocab_size(with_added_tokens=True) == file.count


def merging_every_piece(name: str) -> bool:
    """A BPE file whose tokenizer merges every piece, even one the vocabulary holds whole (no
    `ignore_merges`): SmolLM2's, Qwen2's, GPT-4o's among the fixtures."""
    held = MANIFEST["files"][name]
    return held["tokenizer"] == "gpt2" and not PRE_TOKENIZERS[held["pre"]].ignore_merges


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=(
        "ExecuTorch's C++ BPE looks a piece up whole in the vocabulary before merging, as if "
        "ignore_merges were set: 'Ġbakers' comes out whole where llama.cpp and transformers "
        "merge to 'Ġb' 'akers'"))) if merging_every_piece(name) else name for name in FILES])
def test_executorchs_cpp_tokenizer_reads_the_written_tokenizer_as_llamacpp_does(name, files):
    """The tokenizer.json an export writes, read by ExecuTorch's C++ tokenizer (pytorch_tokenizers'
    HFTokenizer, the one TextLLMRunner loads), gives llama.cpp's ids for the shipped text and the
    sample. Where the file's tokenizer merges every piece, upstream's does not (the mark says how):
    the test fails there as expected, and passes, failing the run, once upstream follows the
    flag."""
    from pytorch_tokenizers import CppHFTokenizer

    file, expected = files(name), MANIFEST["files"][name]["llama_cpp"]["ids"]
    tokenizer = CppHFTokenizer()
    tokenizer.load(str(file.folder / "tokenizer.json"))
    for text_name, text in TEXTS.items():
        ids = tokenizer.encode(text, 0, 0)
        assert ids == expected[text_name]["plain"], f"{name} {text_name}: " + first_difference(
            ids, expected[text_name]["plain"], file.tokens.tokenizer())


@pytest.mark.parametrize("name", FILES)
def test_chat_renders_the_file_s_template_into_llamacpp_s_ids(name, files):
    """The file's `tokenizer.chat_template` is what the export writes for chat, and the
    session's chat (what `edgellm chat` and `serve` send the program) renders a conversation into
    the prompt llama.cpp's chat completion renders and the ids it tokenizes it to (special tokens
    parsed, Phi-3's whitespace after them stripped)."""
    from edgellm.run.session import Session

    file, expected = files(name), MANIFEST["files"][name]["llama_cpp"]["chat"]
    assert (file.folder / "chat_template.jinja").read_text() == file.template
    session = SimpleNamespace(folder=file.folder, _chat=None)  # Session's own methods, no program
    session.chat_template = lambda: Session.chat_template(session)
    rendered = session.chat_template().apply_chat_template(
        MANIFEST["messages"], add_generation_prompt=True, tokenize=False)
    assert rendered == expected["prompt"]
    ids = Session.chat_ids(session, MANIFEST["messages"])
    assert ids == expected["ids"], first_difference(ids, expected["ids"], file.tokens.tokenizer())


def test_a_gguf_model_loads_the_tokenizer_this_builds():
    """load_source on a GGUF gives the tokenizer, BOS and stops tested above."""
    path = Path(__file__).parent / "data" / "gguf" / "llama-Q4_K_M.gguf"
    source, tokens = load_source(str(path)), tokenizer_of(path)
    assert source.tokenizer().to_str() == tokens.tokenizer().to_str()
    assert (source.bos_id, source.eos_ids) == (tokens.bos_id, tokens.eos_ids)


def vocab_only(path: Path, model: str, pre: str | None, merges=("a b",)) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    if merges:
        w.add_token_merges(list(merges))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model, pre, message", [
    ("gpt2", "made-up", r"tokenizer\.ggml\.pre is 'made-up', a pre-tokenizer edgellm does not "
                        r"know; .* Known: .*llama-bpe.* Pass the model's tokenizer\.json from "
                        r"its Hugging Face repository with --tokenizer"),
    ("gpt2", None, r"tokenizer\.ggml\.pre is missing or 'default' \(llama\.cpp then splits by "
                   r"its fallback rules and warns that generation quality is degraded\)"),
    ("gpt2", "default", r"tokenizer\.ggml\.pre is missing or 'default'"),
    ("bert", None, r"tokenizer\.ggml\.model is 'bert'; edgellm builds the tokenizers llama\.cpp "
                   r"calls 'gpt2' and 'llama' .* --tokenizer\."),
])
def test_a_tokenizer_llamacpp_s_rules_here_do_not_cover_is_refused(tmp_path, model, pre, message):
    with pytest.raises(InputError, match=message):
        tokenizer_of(vocab_only(tmp_path / "odd.gguf", model, pre))


def test_a_bpe_tokenizer_without_merges_is_refused_in_one_line(tmp_path):
    """transformers' converter would fail on it with a bare KeyError ('scores')."""
    with pytest.raises(InputError, match=r"tokenizer\.ggml\.merges is missing or empty; a "
                                         r"byte-level BPE tokenizer is its merges .* --tokenizer"):
        tokenizer_of(vocab_only(tmp_path / "odd.gguf", "gpt2", "llama-bpe", merges=()))


def test_an_unknown_pre_tokenizer_is_refused_before_the_weights_unless_replaced(tiny_models,
                                                                               tmp_path):
    """The model is refused at load; a tokenizer given beside it (--tokenizer) replaces the
    file's, and the model loads."""
    from tokenizers import Tokenizer

    from test_sources import write_gguf

    folder, hf = tiny_models["llama"]
    path = tmp_path / "odd.gguf"
    write_gguf(hf, folder / "tokenizer.json", path, pre="made-up")
    with pytest.raises(InputError, match=r"tokenizer\.ggml\.pre is 'made-up'"):
        load_source(str(path))
    source = load_source(str(path), tokenizer=str(folder))
    given = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert source.tokenizer().encode("hello world").ids == given.encode("hello world").ids
