"""GGUF files as llama.cpp's converter writes them, for the architectures that declare how it
does (`registry.GgufLayout`; any other is refused by name from the metadata alone). The file is
read with `gguf`'s own `GGUFReader` (llama.cpp's Python package: header, metadata and tensor
table, every type it knows) and its tensors dequantized by `gguf.quants`, so any type llama.cpp
writes and `gguf` reads loads; a tensor of a type `gguf` cannot dequantize is named, with its
type, before anything is built. The config is rebuilt from the metadata through transformers'
GGUF builder or key table for the architecture (the common keys and the layout's where it has
none), then the layout's `fix` restores what llama.cpp keeps in code or in tensors, and Llama 3's
`rope_freqs` become LongRoPE factors; weights are named by gguf's tensor name map, with what the
converter did undone by transformers' tensor processors (q/k row permutation where the layout
says so, Gemma's norms stored as 1 + w, LFM2's squeezed kernels). Each weight's storage type
(`Q4_1`, `Q8_0`, ...) is kept: recipes read it to keep the file's own grids and precision choices
(quantize/plan.py, quantize/grid.py). The tokenizer, BOS and the ids generation ends at are
llama.cpp's, from gguf_tokenizer.py."""

from __future__ import annotations

import functools
import os
from importlib.metadata import version
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..memory import note_mapped
from .base import Source

# GGUF keys (after "ARCH.") -> config fields, for an architecture transformers has no table for
COMMON_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
               "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
               "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
               "attention.head_count_kv": "num_key_value_heads", "vocab_size": "vocab_size",
               "attention.layer_norm_rms_epsilon": "rms_norm_eps"}


def _unreadable(path: Path, e: Exception) -> InputError:
    return InputError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}). It is "
                      "damaged or not a GGUF file: download it again.")


def _truncated(path: Path, name: str, end: int, size: int) -> InputError:
    return InputError(f"{path} is truncated: its tensor table puts {name} up to byte {end:,}, and "
                      f"the file holds {size:,} bytes. Download it again.")


def load_gguf(path: Path, tokenizer: bool = True, lazy: bool = False) -> Source:
    """The model in the GGUF at `path`; its tokenizer as llama.cpp runs it (gguf_tokenizer.py),
    checked before the weights are read unless `tokenizer` is False (another replaces it). With
    `lazy`, its matrices are not read yet: each a `pending.Pending` that dequantizes it when
    read (a quantizing export reads one at a time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..architectures.pending import Pending
    from ..architectures.registry import for_gguf
    from .gguf_tokenizer import gguf_tokenizer

    reader = _reader(path)
    note_mapped([path])  # its pages are dropped once quantization has replaced their weights
    metadata = _metadata(reader)
    if "general.architecture" not in metadata:
        raise InputError(f"{path} has no general.architecture key: it was not written by "
                         "llama.cpp's converter, or is damaged.")
    arch = metadata["general.architecture"]
    found = for_gguf(arch, path)  # refused by name before anything else is read
    tokens = gguf_tokenizer(path, reader.fields, check=tokenizer)  # built when asked for
    layout = found.gguf
    tensors = {info.name: info for info in reader.tensors}
    names = tuple(tensors)
    values = functools.partial(_values, tensors)
    try:
        raw = _config(found, metadata, names, values)
    except KeyError as e:
        raise InputError(f"{path} lacks the metadata key {e} that llama.cpp writes for a '{arch}' "
                         "model: the file is damaged or was written by another tool.") from None
    cfg = AutoConfig.for_model(**raw)
    with torch.device("meta"):  # the skeleton only tells which Hugging Face names to map to
        skeleton = AutoModelForCausalLM.from_config(cfg)
    hf_names = _hf_names(path, arch, cfg, skeleton)
    processor = _processor(layout, raw)
    state, stored = {}, {}

    def weight(name: str) -> torch.Tensor:
        return _tensor(np.asarray(processor.process(weights=values(name), name=name).weights,
                                  dtype=np.float32))

    wanted = [name for name in names if name in hf_names]
    _readable(path, tensors, wanted + [n for n in names if any(t in n for t in EXPERT_TENSORS)])
    for hf_name, experts in _stacked_experts(path, arch, cfg, skeleton, tensors,
                                             functools.partial(_expert_values, tensors)):
        state[hf_name] = experts
    later = {name for name in wanted if lazy and len(tensors[name].shape) >= 2}
    shapes = {k: v.shape for k, v in skeleton.state_dict().items()} if later else {}
    for name in (name for name in wanted if name in later):
        # the table, which no converter change touches, can be read a block of rows at a time
        rows = functools.partial(_rows, tensors[name]) if name == "token_embd.weight" else None
        state[hf_names[name]] = Pending(name, shapes[hf_names[name]], torch.float32,
                                        functools.partial(weight, name), rows)
    now = [name for name in wanted if name not in later]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # numpy lets go of the GIL
        for name, tensor in zip(now, pool.map(weight, now)):
            state[hf_names[name]] = tensor
    stored.update((hf_names[name], tensors[name].tensor_type.name) for name in wanted)
    return Source(hf_config=cfg, state_dict=state, origin=str(path),
                  write_tokenizer=tokens.write, tokenizer=tokens.tokenizer,
                  bos_id=tokens.bos_id, eos_ids=tokens.eos_ids, stored_types=stored)


def tokenizer_of(path: Path, check: bool = True):
    """The tokenizer of the GGUF at `path` as llama.cpp runs it (gguf_tokenizer.py), its
    metadata read with the file's cached reader."""
    from .gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(path, _reader(path).fields, check)


def storage_kinds(path: Path) -> dict:
    """{tensor name: (storage type, values)} of the file's matrices (two dimensions or more: the
    linears, stacked experts and the table, "embedding"), from its tensor table."""
    out = {}
    for t in _reader(path).tensors:
        if len(t.shape) >= 2:
            name = "embedding" if t.name == "token_embd.weight" else t.name
            out[name] = (t.tensor_type.name, int(t.n_elements))
    return out


def _reader(path: Path):
    """The file's reader, parsed once for both the config's storage types and the load (a
    changed file is parsed again)."""
    stat = Path(path).stat()
    return _parsed(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime: int):
    """`gguf.GGUFReader` of the file, which checks each tensor against the file's size and
    gguf's types before mapping it, so a cut file or an unknown type is named as such. The mapped
    file is held as a plain array: numpy's memmap subclass pays per slice, and the reader takes
    a slice or two per string of the vocabulary."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._mapped

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._mapped = mapped.view(np.ndarray)  # still the mapped file's pages

        def _build_tensors(self, start_offs, fields):  # gguf's own, after the checks
            for field in fields:
                _, name, _, dims, kind, offset = field.parts
                name = bytes(name).decode("utf-8", "replace")
                if int(kind[0]) not in {t.value for t in gguf.GGMLQuantizationType}:
                    raise InputError(
                        f"{path}: tensor {name} is stored as ggml type {int(kind[0])}, which the "
                        f"installed gguf {version('gguf')} does not know (llama.cpp may be "
                        "newer than it): upgrade gguf (pip install -U gguf), or requantize the "
                        "file to a known type with llama.cpp's llama-quantize.")
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind[0])]
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * block_bytes // block
                if end > len(self.data):
                    raise _truncated(path, name, end, len(self.data))
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(path)
    except InputError:
        raise
    except (ValueError, KeyError, IndexError, OSError, EOFError, UnicodeDecodeError) as e:
        raise _unreadable(path, e) from None


def _metadata(reader) -> dict:
    """The file's metadata as transformers' GGUF builders take it: values, lists of numbers, and
    arrays of strings (the vocabulary, merges) as their length (read when the tokenizer is)."""
    from gguf import GGUFValueType

    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[:1] == [GGUFValueType.ARRAY] and field.types[-1] == GGUFValueType.STRING:
            out[key] = len(field.data)
        else:
            out[key] = field.contents()
    return out


def _readable(path: Path, tensors: dict, wanted) -> None:
    """InputError naming every tensor of `wanted` whose type gguf cannot dequantize."""
    import gguf

    unread = {}
    for name in wanted:
        kind = tensors[name].tensor_type
        if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) and \
                getattr(gguf.quants, kind.name, None) is None:
            unread.setdefault(kind.name, []).append(name)
    if unread:
        listed = "; ".join(f"{kind}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                           for kind, names in unread.items())
        raise InputError(f"{path} stores tensors in types that the installed gguf "
                         f"{version('gguf')} cannot dequantize ({listed}); llama.cpp's runtime "
                         "reads them, edgellm reads what gguf does. Requantize the file with "
                         "llama.cpp's llama-quantize to a type such as Q4_K_M or Q8_0.")


def _values(tensors: dict, name: str) -> np.ndarray:
    """One tensor of the mapped file as float32, dequantized by gguf, in torch's shape."""
    info = tensors[name]
    return _decode(info.data, info.tensor_type, _shape(info))


def _rows(info, start: int, end: int) -> torch.Tensor:
    """Rows start..end of a matrix of the mapped file, dequantized (ggml stores it row by row,
    each row whole blocks)."""
    count, width = _shape(info)
    end = min(end, count)
    return _tensor(np.asarray(_decode(info.data[start:end], info.tensor_type,
                                      (end - start, width)), dtype=np.float32))


def _expert_values(tensors: dict, name: str, expert: int) -> np.ndarray:
    """One expert's slice (E, ...) -> (...) of a stacked experts tensor, as `_values` gives a
    whole tensor: llama.cpp stores the experts one after another, each whole rows."""
    info = tensors[name]
    return _decode(info.data[expert], info.tensor_type, _shape(info)[1:])


def _shape(info) -> tuple:
    return tuple(reversed([int(d) for d in info.shape]))  # ggml's order is fastest first


def _decode(data: np.ndarray, kind, shape: tuple) -> np.ndarray:
    """gguf's reader maps F32 and F16 as values and every other type as rows of bytes."""
    import gguf

    if kind == gguf.GGMLQuantizationType.F32:
        out = data
    elif kind == gguf.GGMLQuantizationType.F16:
        out = data.astype(np.float32)
    else:
        out = _dequantize(data.reshape(-1, data.shape[-1]), kind)
    return out.reshape(shape)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A dequantized array as a tensor, copied only where it views the mapped file (or more)."""
    return torch.from_numpy(array if _whole(array) else np.array(array))


def _whole(array: np.ndarray) -> bool:
    """Whether `array` may become a tensor as it is: writeable (not the mapped file), contiguous,
    and all of the memory it views (a part of a larger array would keep the rest alive)."""
    base = array
    while isinstance(base.base, np.ndarray):
        base = base.base
    return (array.flags.writeable and array.flags.c_contiguous and base.base is None
            and base.nbytes == array.nbytes)


DEQUANTIZE_CHUNK = 1 << 22  # values dequantized at once: temporaries of tens of MB


def _dequantize(rows: np.ndarray, kind) -> np.ndarray:
    """gguf's dequantization of `rows` (a row's bytes each) by the type's own `dequantize_rows`
    (the same floats as `gguf.quants.dequantize`), on chunks of a few million values instead of
    gguf's groups of 16 rows: twice as fast on the embedded SmolLM2 (1.3 s against 2.6 s)."""
    import gguf

    quant = getattr(gguf.quants, kind.name, None)
    if quant is None or not hasattr(quant, "dequantize_rows"):
        return gguf.quants.dequantize(rows, kind)
    quant.init_grid()
    block, size = gguf.GGML_QUANT_SIZES[kind]
    width = rows.shape[1] // size * block
    step = max(1, DEQUANTIZE_CHUNK // max(width, 1))
    if step >= rows.shape[0]:
        return quant.dequantize_rows(rows)
    out = np.empty((rows.shape[0], width), dtype=np.float32)
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = quant.dequantize_rows(rows[i:i + step])
    return out


def _config(found, metadata: dict, names: tuple, values) -> dict:
    """The transformers config of the file: transformers' own builder where it has one, else its
    key table (the common keys and the layout's where it has none), then what the tables leave
    out (the layout's `fix`, and Llama 3's `rope_freqs`)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config

    layout = found.gguf
    arch = layout.arch
    if arch in GGUF_CONFIG_ARCHS:
        raw = {k: v for k, v in get_gguf_config(metadata, names).items()
               if k != "_model_name_or_path"}
    else:
        raw = _from_table(found, metadata, names)
    if layout.fix is not None:
        layout.fix(raw, lambda name, default=None: metadata.get(f"{arch}.{name}", default),
                   names, values)
    if "rope_freqs.weight" in names:
        _rope_freqs(raw, values("rope_freqs.weight"))
    return raw


def _from_table(found, metadata: dict, names: tuple) -> dict:
    """The config fields transformers' key table (or the common keys and the layout's) reads,
    and what every family's file says the same way."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    layout = found.gguf
    arch = layout.arch
    raw = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    table = (GGUF_CONFIG_MAPPING.get(arch) or COMMON_KEYS) | layout.keys
    for prefix, keys in ((arch, table), ("tokenizer", GGUF_CONFIG_MAPPING["tokenizer"])):
        for key, field in keys.items():
            if field is not None and f"{prefix}.{key}" in metadata:
                raw[field] = metadata[f"{prefix}.{key}"]
    raw["model_type"] = found.model_type
    raw.setdefault("pad_token_id", None)  # not a config class's default (Phi-3's 32000)
    raw["tie_word_embeddings"] = "output.weight" not in names
    if "vocab_size" not in raw and "tokenizer.ggml.tokens" in metadata:
        raw["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # a count: the list is not read
    key_length = metadata.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers' tables leave it out for some (qwen3, phi3)
        raw.setdefault("head_dim", int(key_length))
    return raw


def _rope_freqs(raw: dict, factors: np.ndarray) -> None:
    """Llama 3.1+'s frequency scaling, which llama.cpp's converter turns into one divisor per
    frequency (`rope_freqs`) and transformers' GGUF tables drop (leaving plain RoPE, wrong past
    the first positions' high frequencies): as LongRoPE with those divisors at every position
    (its original context is the whole context, so it never switches, and no attention
    scaling), transformers computes the same table."""
    factors = factors.tolist()
    raw["rope_parameters"] = {
        "rope_type": "longrope", "rope_theta": raw.pop("rope_theta", 10000.0),
        "short_factor": factors, "long_factor": factors, "attention_factor": 1.0,
        "original_max_position_embeddings": raw["max_position_embeddings"]}


def _hf_names(path: Path, arch: str, cfg, skeleton) -> dict:
    """GGUF tensor name -> Hugging Face parameter name, through gguf's own name map (the one
    llama.cpp's converter writes with), built once."""
    import gguf

    kind = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if kind is None:
        raise InputError(f"{path}: the installed gguf package does not know architecture "
                         f"'{arch}'; upgrade it (pip install -U gguf).")
    names = gguf.get_tensor_name_map(kind, cfg.num_hidden_layers)
    found = {}
    for hf_name in skeleton.state_dict():
        base, _, leaf = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is not None:
            found[f"{gguf_name}.{leaf}"] = hf_name
        elif (not hf_name.endswith(("experts.gate_up_proj", "experts.down_proj"))
              and names.get_name(hf_name) is not None):
            # a module's own tensor (LFM2-MoE's expert_bias), which the converter writes as .bias
            found[f"{names.get_name(hf_name)}.bias"] = hf_name
    return found


EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # llama.cpp's, stacked (E, ..)


def _stacked_experts(path: Path, arch: str, cfg, skeleton, tensors: dict, expert):
    """(name, moe.Deferred) for transformers' stacked experts of every sparse block:
    `experts.gate_up_proj` (E, 2F, D) from the file's `blk.N.ffn_gate_exps` and `ffn_up_exps`,
    `experts.down_proj` (E, D, F) from `ffn_down_exps`. Nothing is read until an expert is
    (`expert(name, e)`: that expert's slice of the mapped file, dequantized), so a quantized
    export reads them one at a time, as it does a folder's."""
    import gguf

    from ..architectures.moe import Deferred

    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(kind, cfg.num_hidden_layers)
    for hf_name in skeleton.state_dict():
        down = names.get_name(hf_name) if hf_name.endswith("experts.down_proj") else None
        if down is None:
            continue
        gate, up, down = (f"{down.replace(EXPERT_TENSORS[2], t)}.weight" for t in EXPERT_TENSORS)
        missing = [n for n in (gate, up, down) if n not in tensors]
        if missing:
            raise InputError(f"{path} lacks {', '.join(missing)}: its config has experts in that "
                             "layer. The file is damaged or was written by another tool.")
        e, f, d = _shape(tensors[gate])
        yield hf_name[:-len("down_proj")] + "gate_up_proj", Deferred(
            (e, 2 * f, d), torch.float32, lambda x, g=gate, u=up: _tensor(
                np.concatenate([expert(g, x), expert(u, x)])))
        yield hf_name, Deferred(_shape(tensors[down]), torch.float32,
                                lambda x, n=down: _tensor(expert(n, x)))


def _processor(layout, raw: dict):
    """transformers' processor of the tensors llama.cpp's converter changed for this family."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS,
                                                          LlamaTensorProcessor, TensorProcessor)

    if layout.permuted:
        return LlamaTensorProcessor(config=raw)
    return TENSOR_PROCESSORS.get(layout.processor or layout.arch, TensorProcessor)(config=raw)
