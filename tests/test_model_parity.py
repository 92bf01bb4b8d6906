"""Parity with transformers (chapters 预填充, 解码): same logits, same greedy tokens, per family."""
import copy

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from minillm import SamplingParams, generate, load_model
from minillm.engine.contiguous_cache import ContiguousKVCache

SHAPE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=1024)
FAMILIES = {
    # llama3 scaling with wavelengths in all three bands (kept, blended, divided) for head_dim 16
    "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, tie_word_embeddings=True)),  # q/k/v biases
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=24)),  # head_dim != 64/4, qk norm
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None)),
}
PROMPT_LENGTHS = (5, 13, 1)


def _save_random_checkpoint(family, folder, **save_kwargs):
    """A tiny transformers model with every parameter random (biases and norms too), saved."""
    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    hf.save_pretrained(folder, **save_kwargs)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, _save_random_checkpoint(request.param, folder)


def _prompts(vocab_size):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _flat_logits(model, prompts, split=None):
    """Logits of every prompt token from one flat forward (or two, cut ``split`` tokens in)."""
    cache = ContiguousKVCache(model.config, len(prompts), max(map(len, prompts)), model.dtype)
    chunks = [[p] for p in prompts] if split is None else [[p[:split], p[split:]] for p in prompts]
    logits = [[] for _ in prompts]
    for step in range(len(chunks[0])):
        rows = [r for r in range(len(prompts)) if chunks[r][step]]
        tokens = [chunks[r][step] for r in rows]
        positions, attn = cache.append(rows, [len(t) for t in tokens])
        hidden = model(torch.tensor(sum(tokens, [])), positions, attn, cache.layer_caches)
        out = model.compute_logits(hidden)
        for i, r in enumerate(rows):
            logits[r].append(out[attn.cu_seqlens_q[i]:attn.cu_seqlens_q[i + 1]])
    return [torch.cat(parts) for parts in logits]


def test_config_features(checkpoint):
    family, folder, hf = checkpoint
    model = load_model(folder, device="cpu")
    cfg = model.config
    assert cfg.model_type == family
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.tie_word_embeddings == (family == "qwen2")
    if family == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if family == "qwen3":
        assert cfg.head_dim * cfg.num_heads != cfg.hidden_size
    torch.testing.assert_close(model.rotary.inv_freq, hf.model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_llama3_rope_scaling_covers_all_bands():
    import math

    from minillm.engine.config import load_config
    from minillm.engine.model import rope_inv_freq

    scaled_cfg = load_config("tiny").replace(head_dim=16, rope_theta=500000.0,
                                             rope_scaling=dict(LLAMA3_ROPE))
    plain, scaled = rope_inv_freq(scaled_cfg.replace(rope_scaling=None)), rope_inv_freq(scaled_cfg)
    wavelen = 2 * math.pi / plain
    kept, divided = wavelen < 1024 / 4, wavelen > 1024
    blended = ~kept & ~divided
    assert kept.any() and divided.any() and blended.any()
    assert torch.equal(scaled[kept], plain[kept])
    torch.testing.assert_close(scaled[divided], plain[divided] / 8)
    assert ((scaled[blended] < plain[blended]) & (scaled[blended] > plain[blended] / 8)).all()


def test_logits_match_transformers(checkpoint):
    _, folder, hf = checkpoint
    model = load_model(folder, device="cpu", dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size)
    with torch.no_grad():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
    for ours, ref in zip(_flat_logits(model, prompts), expected):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)
    # the same tokens in two steps: the second attends to a cached prefix
    for ours, ref in zip(_flat_logits(model, prompts, split=3), expected):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def hf_greedy_64(checkpoint):
    """transformers' greedy continuation of each prompt, 64 steps in float64 (argmax loop)."""
    _, _, hf = checkpoint
    hf = copy.deepcopy(hf).to(torch.float64)
    continuations = []
    with torch.no_grad():
        for prompt in _prompts(hf.config.vocab_size):
            tokens = list(prompt)
            for _ in range(64):
                tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
            continuations.append(tokens[len(prompt):])
    return continuations


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_64_steps_matches_transformers(checkpoint, hf_greedy_64, use_cache):
    _, folder, _ = checkpoint
    model = load_model(folder, device="cpu", dtype=torch.float64)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ours = generate(model, _prompts(model.config.vocab_size), params, use_cache=use_cache)
    assert len(set(sum(ours, []))) >= 8  # varied output, so a mismatch would show
    assert ours == hf_greedy_64


def test_sharded_checkpoint_loads_like_a_single_file(checkpoint, tmp_path):
    family, folder, _ = checkpoint
    _save_random_checkpoint(family, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    sharded, single = load_model(tmp_path, device="cpu"), load_model(folder, device="cpu")
    assert sharded.tokenizer is None  # transformers saved no tokenizer here
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name


def test_tokenizer_loaded_with_the_checkpoint(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _save_random_checkpoint("llama", tmp_path)
    vocab = {f"w{i}": i for i in range(SHAPE["vocab_size"] - 1)} | {"[UNK]": SHAPE["vocab_size"] - 1}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]").save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cpu")
    assert model.tokenizer("w3 w7 nope")["input_ids"] == [3, 7, SHAPE["vocab_size"] - 1]
