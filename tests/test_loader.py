"""load_model (chapter 预填充): presets, random weights at a real shape, clear errors."""
import json
import sys

import pytest
import torch
from safetensors.torch import save_file

from minillm import load_model
from minillm.engine.config import PRESETS_DIR, load_config
from minillm.lab.estimate import param_count
from minillm.engine.model import RMSNorm


def test_preset_without_weights_says_use_random():
    with pytest.raises(ValueError, match="no weights.*weights='random'"):
        load_model("tiny", device="cpu")


def test_random_weights_at_the_preset_shape():
    model = load_model("tiny", device="cpu", weights="random")
    cfg = model.config
    assert cfg == load_config("tiny") and model.tokenizer is None
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" and not p.requires_grad
               for p in model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1  # one buffer
    for module in model.modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == 1)
    embed = model.model.embed_tokens.weight
    assert 0.018 < embed.std().item() < 0.022 and abs(embed.mean().item()) < 1e-3
    again = load_model("tiny", device="cpu", weights="random")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)  # seeded: repeatable


@pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages are Linux's")
def test_only_weights_that_stay_ask_for_huge_pages(monkeypatch):
    """The full-precision buffer asks for 2 MiB pages when the model keeps it, not when
    quantization replaces the weights and frees it right after."""
    asked = []
    monkeypatch.setattr("minillm.engine.loader._ask_for_huge_pages", lambda buffer: asked.append(buffer.nbytes))
    model = load_model("tiny", device="cpu", weights="random")
    assert asked == [model.model.embed_tokens.weight.untyped_storage().nbytes()]
    asked.clear()
    load_model("tiny", device="cpu", weights="random", quantization="int8")
    assert asked == []


def test_random_weights_from_a_config_with_tied_embeddings_and_dtype():
    cfg = load_config("tiny").replace(num_layers=1, tie_word_embeddings=True, qk_norm=True)
    model = load_model(cfg, device="cpu", dtype=torch.float64, weights="random")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype == torch.float64
    assert torch.all(model.model.layers[0].self_attn.q_norm.weight == 1)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)  # the ledger counts q/k norms
    with pytest.raises(ValueError, match="carries no weights"):
        load_model(cfg, device="cpu")


@pytest.mark.parametrize("kwargs, match", [
    (dict(weights="zeros"), "weights must be one of"),
    (dict(dtype=torch.int8), "dtype must be a floating"),
    (dict(dtype="float32"), "dtype must be a floating"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_model("tiny", device="cpu", **{"weights": "random", **kwargs})


def test_unknown_model_and_offline_hub(monkeypatch):
    with pytest.raises(ValueError, match="unknown model.*not a preset"):
        load_model("no such model", device="cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        load_model("some-org/some-model", device="cpu")


def _tiny_checkpoint(folder, drop=(), reshape=()):
    """Save the weights of a 1-layer random model, minus ``drop``, with ``reshape`` tensors cut."""
    cfg = load_config("tiny").replace(num_layers=1)
    tensors = {name: t.clone() for name, t in
               load_model(cfg, device="cpu", weights="random").state_dict().items() if name not in drop}
    for name in reshape:
        tensors[name] = tensors[name][:-1]
    save_file(tensors, folder / "model.safetensors")
    hf_config = json.loads((PRESETS_DIR / "tiny" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hf_config | {"num_hidden_layers": 1}))
    return tensors


def test_checkpoint_roundtrip_and_mismatches(tmp_path):
    tensors = _tiny_checkpoint(tmp_path)
    model = load_model(tmp_path, device="cpu")
    assert all(torch.equal(model.state_dict()[name], t) for name, t in tensors.items())
    _tiny_checkpoint(tmp_path, drop=("model.norm.weight",))
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        load_model(tmp_path, device="cpu")
    _tiny_checkpoint(tmp_path, reshape=("lm_head.weight",))
    with pytest.raises(ValueError, match="lm_head.weight has shape"):
        load_model(tmp_path, device="cpu")
