"""A corpus of bad inputs through the command line: each ends with one line naming the problem,
exit code 2, no traceback, and nothing at the destination (no output folder, no partial one)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgellm.cli import main


def copy_of(folder, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    return out


def short_layer_types(folder, tmp_path):
    out = copy_of(folder, tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["layer_types"] = config["layer_types"][:-1]
    (out / "config.json").write_text(json.dumps(config))
    return [str(out)]


def misshaped_tensor(folder, tmp_path):
    out = copy_of(folder, tmp_path)
    [file] = out.glob("*.safetensors")
    state = load_file(file)
    name = next(k for k in state if k.endswith("q_proj.weight"))
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, file, metadata={"format": "pt"})
    return [str(out)]


def shard_outside_the_folder(folder, tmp_path):
    out = copy_of(folder, tmp_path)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../../etc/passwd"}}))
    return [str(out)]


def corrupt_gguf(folder, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return [str(path)]


def truncated_gguf(folder, tmp_path):
    """A whole header, then the tensor data cut off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from test_sources import write_gguf

    path = tmp_path / "model.gguf"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    write_gguf(model, folder / "tokenizer.json", path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 3 // 4])
    return [str(path)]


def gguf_with(folder, tmp_path, kind=None, type_id=None):
    """The tiny model's GGUF with its output norm stored as `kind` (a gguf type), or with that
    tensor's type id in the table replaced by `type_id` (one gguf does not know)."""
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    from test_sources import write_gguf

    path = tmp_path / "model.gguf"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    norm = model.state_dict()["model.norm.weight"]
    stored = {"model.norm.weight": (norm.to(torch.int8).numpy(), kind)} if kind else None
    write_gguf(model, folder / "tokenizer.json", path, stored)
    if type_id is not None:  # name, n_dims (u32), dims (u64 each), then the type (u32)
        data = bytearray(path.read_bytes())
        at = data.index(b"output_norm.weight") + len(b"output_norm.weight")
        dims = int.from_bytes(data[at:at + 4], "little")
        at += 4 + 8 * dims
        data[at:at + 4] = type_id.to_bytes(4, "little")
        path.write_bytes(bytes(data))
    return [str(path)]


def gguf_of_a_type_gguf_cannot_dequantize(folder, tmp_path):
    import gguf

    return gguf_with(folder, tmp_path, kind=gguf.GGMLQuantizationType.I8)


def gguf_of_an_unknown_type(folder, tmp_path):
    return gguf_with(folder, tmp_path, type_id=77)


def unreadable_tokenizer(folder, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    return [str(folder), f"tokenizer={path}"]


def broken_tokenizer_in_folder(folder, tmp_path):
    out = copy_of(folder, tmp_path)
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    return [str(out)]


def missing_tokenizer(folder, tmp_path):
    return [str(folder), f"tokenizer={tmp_path / 'none.json'}"]


def bad_yaml(folder, tmp_path):
    (tmp_path / "c.yaml").write_text("backends: [xnnpack\n")
    return [str(folder), "--config", str(tmp_path / "c.yaml")]


def parent_is_a_file(folder, tmp_path):
    (tmp_path / "file").write_text("")
    return [str(folder), "-o", str(tmp_path / "file" / "out")]


CASES = [
    ("lfm2", short_layer_types, r"config\.json contradicts itself: `num_hidden_layers` \(4\) must "
                                r"be equal to the number of `layer_types` \(3\)\. Fix config\.json"),
    ("llama", misshaped_tensor, r"mis-shaped tensors: model\.layers\.0\.self_attn\.q_proj\.weight "
                                r"\(64, 63\) \(expected \(64, 64\)\)"),
    ("llama", shard_outside_the_folder, r"model\.safetensors\.index\.json names shards outside the "
                                        r"folder: \['\.\./\.\./etc/passwd'\]"),
    ("llama", corrupt_gguf, r"model\.gguf is not a readable GGUF file \(.*\)\. It is damaged or "
                            r"not a GGUF file"),
    ("llama", truncated_gguf, r"model\.gguf is truncated: its tensor table puts [a-z_.0-9]+ up to "
                              r"byte [0-9,]+, and the file holds [0-9,]+ bytes"),
    ("llama", gguf_of_a_type_gguf_cannot_dequantize,
     r"model\.gguf stores tensors in types that the installed gguf \S+ cannot dequantize \(I8: "
     r"output_norm\.weight\); llama\.cpp's runtime reads them"),
    ("llama", gguf_of_an_unknown_type, r"model\.gguf: tensor output_norm\.weight is stored as ggml "
                                       r"type 77, which the installed gguf \S+ does not know"),
    ("llama", unreadable_tokenizer, r"tokenizer\.json is not a readable tokenizer\.json"),
    ("llama", broken_tokenizer_in_folder, r"model/tokenizer\.json is not a readable "
                                          r"tokenizer\.json"),
    ("llama", missing_tokenizer, r"Tokenizer .*none\.json is neither a tokenizer\.json nor a "
                                 r"folder holding one"),
    ("llama", bad_yaml, r"c\.yaml is not valid YAML at line 2, column 1"),
    ("llama", parent_is_a_file, r"Cannot write .*file/out: its parent folder .*file does not "
                                r"exist"),
    ("llama", lambda f, t: [str(f), "--backend", "xnnpack,coreml"],
     r"backends: coreml after xnnpack in xnnpack,coreml would only see what XNNPACK leaves.*"
     r"e\.g\. coreml,xnnpack"),
    ("llama", lambda f, t: [str(f), "--backend", "portable,xnnpack"],
     r"'portable' means no delegate and cannot be chained"),
    ("llama", lambda f, t: [str(f), "--quantize", "8da4w", "--backend", "vulkan"],
     r"quantize: 8da4w on vulkan: vulkan has no kernels for it"),
]


@pytest.mark.parametrize("arch, make, match", CASES,
                         ids=[c[1].__name__ if c[1].__name__ != "<lambda>" else f"options{i}"
                              for i, c in enumerate(CASES)])
def test_bad_input_is_refused_in_one_line(tiny_models, tmp_path, capsys, arch, make, match):
    import re

    args = make(tiny_models[arch][0], tmp_path)
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out")]
    assert main(["export", *args, "--quiet", "--max-seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgellm: ") and err.count("\n") == 1, err
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.rglob("*") if ".partial-" in p.name]


def test_a_backend_whose_sdk_is_missing_is_named(tiny_models, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "coremltools" else real(name, *a))
    out = tmp_path / "out"
    assert main(["export", str(tiny_models["llama"][0]), "-o", str(out), "--backend", "coreml",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == ("edgellm: Backend 'coreml' needs coremltools, which is not installed. Install "
                   "it (pip install coremltools) or choose another backend; `edgellm models` "
                   "lists them.\n")
    assert not out.exists() and list(tmp_path.iterdir()) == []
