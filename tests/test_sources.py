"""Where weights come from: Hugging Face folders (single file or shards) and their refusals."""

import json
import shutil

import pytest
import torch

from edgellm.errors import InputError
from edgellm.sources import load_source


def test_sharded_folder_loads_the_same_tensors(tiny_models, tmp_path):
    folder, hf = tiny_models["lfm2"]
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one, many = load_source(str(folder)), load_source(str(tmp_path / "sharded"))
    assert sorted(one.state_dict) == sorted(many.state_dict)
    assert all(torch.equal(one.state_dict[k], many.state_dict[k]) for k in one.state_dict)
    assert (one.bos_id, one.eos_ids) == (0, (1,))


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(InputError, match=r"has no config\.json"):
        load_source(str(tmp_path / "m"))


def test_folder_without_weights(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    (tmp_path / "m").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "m")
    with pytest.raises(InputError, match=r"has no \*\.safetensors weights"):
        load_source(str(tmp_path / "m"))


def test_truncated_safetensors(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    shutil.copytree(folder, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"model\.safetensors is not a readable safetensors file"):
        load_source(str(tmp_path / "m"))


def test_index_naming_a_missing_shard(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(InputError, match="lists shards that are missing: model-00001-of-00002"):
        load_source(str(tmp_path / "m"))
