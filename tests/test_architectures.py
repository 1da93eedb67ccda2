"""The architectures (edgellm/architectures/): our eager models against transformers in every
formulation a backend may ask for, the one weight loader, and what each architecture refuses."""

import pytest
import torch

from conftest import assert_logits_close, cached_run, reference_run
from edgellm.errors import InputError
from edgellm.architectures import build_model
from edgellm.architectures.layers import ModelOptions
from edgellm.backends import BACKENDS

# Every backend's formulation, and the other spellings the options allow
FORMULATIONS = {name: b.writing for name, b in BACKENDS.items()} | {
    "window conv, index_put": {"conv": "window", "state_write": "index_put", "norm": "rms_norm"},
    "matrix rope, folded mean norm": {"rope": "matrix", "norm": "mean", "fold_norms": True}}


@pytest.mark.parametrize("arch", ["lfm2", "llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("writing", FORMULATIONS.values(), ids=FORMULATIONS.keys())
def test_eager_matches_transformers(tiny_models, prompt_ids, arch, writing):
    _, hf = tiny_models[arch]
    tokens, expected = reference_run(hf, prompt_ids, steps=9)  # prefill + 8 decode calls
    model = build_model(hf.config, hf.state_dict(), ModelOptions(64, **writing), torch.float32)
    with torch.no_grad():
        actual = cached_run(model, prompt_ids, tokens)
        # A new sequence at position 0 must not see the previous one's conv state or cache.
        again = cached_run(model, prompt_ids, tokens)
    assert_logits_close(actual, expected, atol=1e-4, what=f"{arch} {writing}")
    assert torch.equal(actual, again)


def test_loader_names_missing_unexpected_and_misshaped(tiny_models):
    _, hf = tiny_models["llama"]
    sd = dict(hf.state_dict())
    sd.pop("model.norm.weight")
    sd["model.extra.weight"] = torch.zeros(3)
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 5)
    with pytest.raises(InputError, match=r"missing tensors: model\.norm\.weight.*unexpected "
                       r"tensors: model\.extra\.weight.*mis-shaped tensors: "
                       r"model\.layers\.0\.mlp\.up_proj\.weight \(5, 5\)"):
        build_model(hf.config, sd, ModelOptions(), torch.float32)


def test_lfm2_layer_types_must_match_layer_count(tiny_models, tmp_path):
    import json
    import shutil

    from edgellm.sources import load_source

    folder, _ = tiny_models["lfm2"]
    shutil.copytree(folder, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["layer_types"] = ["conv"] * 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match=r"config\.json contradicts itself: .*num_hidden_layers"
                       r".*4.*layer_types.*3"):
        load_source(str(tmp_path / "m"))


def test_qwen3_sliding_window_layers_keep_ring_buffers(tiny_models):
    """Qwen3 with use_sliding_window (which released checkpoints leave off) slides from
    max_window_layers on; such layers keep a ring of their window and match transformers past
    it."""
    import copy

    from transformers import AutoModelForCausalLM

    _, hf = tiny_models["qwen3"]
    cfg = copy.deepcopy(hf.config)
    cfg.use_sliding_window, cfg.sliding_window = True, 4
    cfg.layer_types = ["full_attention", "sliding_attention"]
    sliding = AutoModelForCausalLM.from_config(cfg).eval()
    sliding.load_state_dict(hf.state_dict())
    prompt = list(range(2, 8))
    tokens, expected = reference_run(sliding, prompt, steps=12)
    model = build_model(cfg, hf.state_dict(), ModelOptions(32, max_call_len=8), torch.float32)
    assert model.model.layers[1].self_attn.cache.k_cache.shape[2] == 4 + 8 - 1  # (1, kv, slots, D)
    with torch.no_grad():
        actual = cached_run(model, prompt, tokens)
    assert_logits_close(actual, expected, atol=1e-4, what="qwen3 sliding")
