"""A GGUF file's tokenizer as llama.cpp runs it, built with the `tokenizers` library. transformers
converts what the file stores (the byte-level BPE vocabulary and merges, or the SentencePiece
vocabulary with merges ranked by score; control and user-defined tokens as added tokens); then
what llama.cpp keeps in code is set from tables that mirror it:

- a BPE file's pre-tokenizer, by its `tokenizer.ggml.pre` name: PRE_TOKENIZERS mirrors the split
  expressions of llama.cpp's `llm_tokenizer_bpe` constructor (as the tokenizer.json they were
  taken from writes them, which llama.cpp rewrites for std::regex) and the flags
  `llama_vocab::impl::load` sets by name (a piece that is a token is that token, merges unused;
  BOS added when the file does not say). transformers maps most names to the right expression
  but splits some (`smollm`, `refact`) as plain GPT-2, and sets neither flag;
- a SentencePiece file is tokenized as llama.cpp's `llm_tokenizer_spm` does for every family:
  spaces escaped as "▁", one "▁" before the text and after each added token when
  `tokenizer.ggml.add_space_prefix` says so (true unless the file says otherwise), no split, byte
  fallback; runs of spaces the file marks user-defined (Gemma's) stay added tokens spelled with
  spaces, where transformers' Gemma builder respells them (and merges them away);
- BOS and EOS are added as `tokenizer.ggml.add_bos_token` / `add_eos_token` say, else as llama.cpp
  defaults (BOS for SentencePiece and the names that set it);
- added tokens the file does not hold (defaults of transformers' classes, such as `<|endoftext|>`
  in a Llama 3 vocabulary) are dropped: their ids lie past the model's table;
- Phi-3 files (llama.cpp goes by `general.name`) strip the whitespace after their control and
  user-defined tokens, as llama.cpp does;
- the ids generation ends at are llama.cpp's end-of-generation set (`llama_vocab::impl::load`):
  EOS, EOT and EOM from the file and every token spelled as one llama.cpp ends at (EOG_TEXTS,
  FIM_TEXTS).

A BPE pre-tokenizer name outside the table is refused rather than guessed: another split gives ids
the model was not trained on, with nothing to show it but worse text.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

BY_WORD_3_DIGITS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BY_WORD_1_DIGIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_ENDINGS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
BY_CASE_3_DIGITS = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_ENDINGS}"
                    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_ENDINGS}"
                    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BY_CASE_1_DIGIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+"
                   rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                   r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DIGIT = r"\p{N}"  # each digit apart
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class Pre:
    """llama.cpp's pre-tokenizer of a name: `splits`, each applied to the pieces of the one before
    (matches and the text between them kept apart); `ignore_merges`: a piece that is a token is
    that token; `add_bos`: BOS added when the file does not say."""
    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


def _names(names: str, pre: Pre) -> dict:
    return dict.fromkeys(names.split(), pre)


PRE_TOKENIZERS = {
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             Pre((BY_WORD_3_DIGITS,), ignore_merges=True, add_bos=True)),
    **_names("dbrx smaug-bpe", Pre((BY_WORD_3_DIGITS,))),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
             Pre((BY_WORD_1_DIGIT,))),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", Pre((BY_CASE_3_DIGITS,))),
    "tekken": Pre((BY_CASE_1_DIGIT,), ignore_merges=True, add_bos=True),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
             Pre((DIGIT, GPT2))),
}

# the texts of the tokens llama.cpp ends generation at, and of FIM pad, repo and file separator
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
             "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
             "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
FIM_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
             "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
             "fim_sep": ("<|file_sep|>",)}
# tokenizer.ggml.model of a byte-level BPE file and of a SentencePiece one (llama.cpp's names)
KINDS = tuple("gpt2 llama".split())
BPE, SPM = KINDS
# what general.name holds in the files whose added tokens llama.cpp strips whitespace after
STRIPPING_NAMES = tuple("phi-3 phi3".split())


@dataclass(frozen=True)
class Settings:
    """What llama.cpp decides from the file beyond its vocabulary."""
    kind: str  # tokenizer.ggml.model, one of KINDS
    pre_name: str | None  # tokenizer.ggml.pre
    pre: Pre | None  # of a BPE file
    space_prefix: bool
    add_bos: bool
    add_eos: bool
    strip_after_added: bool  # whitespace after added tokens stripped


@dataclass
class GgufTokenizer:
    """The file's tokenizer (built when first asked for), BOS, and the ids generation ends at."""
    path: Path
    settings: Settings
    bos_id: int | None
    eos_ids: tuple[int, ...]

    @functools.cached_property
    def converted(self):
        """transformers' tokenizer object, which holds the chat template and writes the files."""
        return _convert(self.path, self.settings)

    def tokenizer(self):
        """The `tokenizers.Tokenizer` (what tokenizer.json holds)."""
        return self.converted.backend_tokenizer

    def write(self, out: Path) -> bool:
        """tokenizer.json, tokenizer_config.json and the chat template into `out`."""
        self.converted.save_pretrained(str(out))
        return (out / "tokenizer.json").is_file()


def gguf_tokenizer(path: Path, fields, check: bool = True) -> GgufTokenizer:
    """The tokenizer of the GGUF at `path`, whose metadata `fields` (gguf's reader's) hold;
    InputError for a tokenizer this module cannot build as llama.cpp runs it, at once with
    `check`, else when it is built."""

    def value(key: str, default=None):
        field = fields.get(f"tokenizer.ggml.{key}")
        return default if field is None else field.contents()

    kind, pre_name = value("model"), value("pre")
    pre = PRE_TOKENIZERS.get(pre_name or "") if kind == BPE else None
    if check:
        merges = fields.get("tokenizer.ggml.merges")
        _check(path, kind, pre_name, pre, merges is not None and len(merges.data) > 0)
    spm = kind == SPM
    name = str(fields["general.name"].contents()).lower() if "general.name" in fields else ""
    bos = value("bos_token_id")
    add_bos = value("add_bos_token", spm or (pre is not None and pre.add_bos))
    settings = Settings(kind, pre_name, pre, spm and bool(value("add_space_prefix", True)),
                        bool(add_bos) and bos is not None, bool(value("add_eos_token", False)),
                        any(part in name for part in STRIPPING_NAMES))
    return GgufTokenizer(path, settings, bos, _stops(fields, value))


def _check(path: Path, kind, name, pre: Pre | None, merges: bool) -> None:
    if kind not in KINDS:
        said = f"is {kind!r}" if kind else "is missing"
        raise InputError(f"{path}: tokenizer.ggml.model {said}; edgellm builds the "
                         f"tokenizers llama.cpp calls {' and '.join(map(repr, KINDS))} "
                         "(byte-level BPE, SentencePiece). Pass the model's tokenizer.json from "
                         "its Hugging Face repository with --tokenizer.")
    if kind == BPE and pre is None:
        said = (f"is {name!r}, a pre-tokenizer edgellm does not know" if name and
                name != "default" else "is missing or 'default' (llama.cpp then splits by its "
                "fallback rules and warns that generation quality is degraded)")
        raise InputError(f"{path}: tokenizer.ggml.pre {said}; the split decides every id, and "
                         "a guessed one gives ids the model was not trained on. Known: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}. Pass the model's tokenizer.json "
                         "from its Hugging Face repository with --tokenizer, or convert the "
                         "model again with a current llama.cpp.")
    if kind == BPE and not merges:  # transformers' converter would fail on a KeyError
        raise InputError(f"{path}: tokenizer.ggml.merges is missing or empty; a byte-level BPE "
                         "tokenizer is its merges (llama.cpp's converter writes them). Pass the "
                         "model's tokenizer.json from its Hugging Face repository with "
                         "--tokenizer.")


def _stops(fields, value) -> tuple[int, ...]:
    """EOS, EOT and EOM as the file gives them, then the ids of tokens spelled as llama.cpp's
    end-of-generation texts, and FIM pad, repo and file separator (the file's ids, else the
    tokens spelled as llama.cpp looks for them)."""
    given = [value(f"{k}_token_id") for k in ("eos", "eot", "eom")]
    found = _spelled(fields.get("tokenizer.ggml.tokens"),
                     EOG_TEXTS + tuple(t for texts in FIM_TEXTS.values() for t in texts))
    others = [i for t in EOG_TEXTS for i in found.get(t, ())]
    for key, texts in FIM_TEXTS.items():
        own = value(f"{key}_token_id")
        others += [own] if own is not None else [i for t in texts for i in found.get(t, ())]
    return tuple(dict.fromkeys(int(i) for i in [*given, *sorted(others)] if i is not None))


def _spelled(field, texts) -> dict[str, list[int]]:
    """{text: ids} of the vocabulary's tokens spelled as one of `texts` (a token's bytes are read
    only where its length is one of theirs)."""
    wanted = {t.encode(): t for t in texts}
    sizes = {len(b) for b in wanted}
    found = {}
    for token_id, part in enumerate(field.data if field is not None else ()):
        raw = field.parts[part]
        if raw.size in sizes and raw.tobytes() in wanted:
            found.setdefault(wanted[raw.tobytes()], []).append(token_id)
    return found


def _convert(path: Path, settings: Settings):
    """transformers' conversion of the file, then llama.cpp's settings (module docstring)."""
    from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, vocabulary, config = get_gguf_tokenizer(str(path))
    _check(path, settings.kind, settings.pre_name, settings.pre, bool(vocabulary.get("merges")))
    spm = settings.kind == SPM
    # every SentencePiece file through transformers' plain builder: llama.cpp runs one algorithm
    fast, extra = convert_gguf_tokenizer(SPM if spm else arch, vocabulary)
    fast = _file_tokens_only(fast, len(vocabulary["tokens"]))
    if spm:
        fast.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁")] * settings.space_prefix + [normalizers.Replace(" ", "▁")])
        fast.pre_tokenizer = None
        fast.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + [decoders.Strip(" ", 1, 0)] * settings.space_prefix)
    else:
        fast.pre_tokenizer = pre_tokenizers.Sequence(
            [_split(r) for r in settings.pre.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        fast.model.ignore_merges = settings.pre.ignore_merges
    if settings.strip_after_added:  # llama.cpp: RSTRIP on them all, </s> too, but not <unk>,
        # <s>, <|endoftext|>
        for t in fast.get_added_tokens_decoder().values():
            if t.content not in ("<unk>", "<s>", "<|endoftext|>"):
                again = AddedToken(t.content, rstrip=True, lstrip=t.lstrip, normalized=False,
                                   single_word=t.single_word, special=t.special)
                (fast.add_special_tokens if t.special else fast.add_tokens)([again])
    config.update(add_bos_token=settings.add_bos, add_eos_token=settings.add_eos)
    return PreTrainedTokenizerFast(tokenizer_object=fast, **config, **extra)


def _split(expression: str):
    """The pre-tokenizer that isolates each match of `expression`: `Digits` for single digits,
    which is what ExecuTorch's C++ tokenizer (TextLLMRunner's) reads the same way (it gives no
    tokens for a `Split` on \\p{N}), else a `Split`."""
    from tokenizers import Regex, pre_tokenizers

    if expression == DIGIT:
        return pre_tokenizers.Digits(individual_digits=True)
    return pre_tokenizers.Split(Regex(expression), behavior="isolated")


def _file_tokens_only(fast, count: int):
    """`fast` without the added tokens past the file's `count` tokens."""
    from tokenizers import Tokenizer

    if all(i < count for i in fast.get_added_tokens_decoder()):
        return fast
    spec = json.loads(fast.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < count]
    return Tokenizer.from_str(json.dumps(spec))
