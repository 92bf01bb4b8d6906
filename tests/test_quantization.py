"""Weight-only quantization (chapter 量化): the formats' error bounds, Q4_1 weights reproduced
exactly, the CPU kernels and the Triton kernel (under its interpreter) against the dequantized
weights, the bytes saved, and quantized greedy output that does not depend on the schedule."""
import pytest
import torch
from torch import nn

from minillm import LLM, SamplingParams, load_model
from minillm.engine.config import load_config, resolve_checkpoint
from minillm.engine.gguf_file import GGUFFile
from minillm.engine.kernels.triton_quant import int4_linear, int8_linear
from minillm.engine.planner import model_bytes
from minillm.engine.quantization import (Int4Linear, Int8Linear, dequantize_int4, pack_int4,
                                         quantize_int4, quantize_int8)


def weights(n=96, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_rounds_each_weight_to_its_channel_grid():
    w = weights()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_rounds_each_weight_to_its_group_grid(group_size):
    w = weights()
    q, scale, low = quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) == 15 and int(q.min()) == 0
    back = dequantize_int4(q, scale, low, group_size)
    step = scale.float().repeat_interleave(group_size, dim=1)
    assert torch.all((back - w).abs() <= step / 2 + 2e-3 * step + 1e-6)  # + fp16 rounding of scale/min


def test_int4_with_groups_of_32_reproduces_smollm2s_q4_1_weights_exactly():
    """The GGUF's Q4_1 blocks are w = d·q + m with fp16 d and m: quantizing the dequantized
    weights again finds the same grid, and dequantizing gives every weight back bit for bit."""
    gguf = GGUFFile(resolve_checkpoint("smollm2-135m"))
    for name in ("blk.0.ffn_up.weight", "blk.7.attn_output.weight", "blk.29.ffn_down.weight"):
        tensor = gguf.tensors[name]
        assert tensor.type_name == "Q4_1"
        w = gguf.read(tensor)
        q, scale, low = quantize_int4(w, 32)
        assert torch.equal(dequantize_int4(q, scale, low, 32), w), name


def test_pack_puts_code_2j_in_the_low_nibble():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[0x21, 0x0F]]


def test_the_triton_kernel_matches_the_dequantized_weights():
    """Run under TRITON_INTERPRET=1 on the CPU (conftest): both formats, a row count that is not a
    multiple of the 16-row tile, and N not a multiple of the 64-column tile."""
    w, x = weights(n=80, k=256), torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    q8, s8 = quantize_int8(w)
    torch.testing.assert_close(int8_linear(x, q8, s8), x @ (q8.float() * s8[:, None]).t(),
                               rtol=1e-5, atol=1e-5)
    for group_size in (32, 128):
        q4, scale, low = quantize_int4(w, group_size)
        params = torch.stack((scale, low), dim=-1).transpose(0, 1).contiguous()
        torch.testing.assert_close(int4_linear(x, pack_int4(q4), params, group_size),
                                   x @ dequantize_int4(q4, scale, low, group_size).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [lambda lin: Int8Linear(lin), lambda lin: Int4Linear(lin, 32)],
                         ids=["int8", "int4"])
def test_cpu_layers_compute_with_their_dequantized_weights(layer):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    quantized = layer(linear)
    x = torch.randn(3, 7, 256)
    exact = x.double() @ quantized.dequantized().double().t() + linear.bias.double()
    torch.testing.assert_close(quantized(x.double()), exact)  # float64: the dequantized weights
    fast = quantized(x)  # float32 in, the CPU kernel (bf16 or int8 activations)
    assert fast.shape == (3, 7, 96) and fast.dtype == torch.float32
    assert (fast.double() - exact).abs().max() < 0.05 * exact.abs().max()


def test_a_quantized_model_holds_fewer_bytes():
    full = load_model("tiny", device="cpu", weights="random")
    int8 = load_model("tiny", device="cpu", weights="random", quantization="int8")
    int4 = load_model("tiny", device="cpu", weights="random", quantization="int4", group_size=128)
    cfg = load_config("tiny")
    embedding = cfg.vocab_size * cfg.hidden_size * 4
    linear = sum(m.weight.numel() for m in full.modules() if isinstance(m, nn.Linear))
    assert int8.quantization == ("int8", 32) and int4.quantization == ("int4", 128)
    assert model_bytes(int8) < model_bytes(full) - 2.9 * linear  # 4 bytes -> 1 per linear weight
    assert model_bytes(int4) < model_bytes(int8) and not any(
        isinstance(m, nn.Linear) for m in int4.modules())
    assert int4.model.embed_tokens.weight.nbytes == embedding  # the lookup table stays float32
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model("tiny", device="cpu", weights="random", quantization="int3")
    with pytest.raises(ValueError, match="group_size must be one of"):
        load_model("tiny", device="cpu", weights="random", quantization="int4", group_size=64)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_greedy_output_does_not_depend_on_the_schedule(quantization, one_thread):
    """Float64 (exact dequantized weights): the same tokens alone, batched, chunked, preempted."""
    model = load_model("tiny", device="cpu", dtype=torch.float64, weights="random",
                       quantization=quantization)
    prompts = [[(7 * i + j) % 4096 for j in range(n)] for i, n in enumerate((40, 9, 23))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [LLM(model, num_kv_blocks=32, quantization=quantization).generate([p], params, use_tqdm=False)[0]
             .token_ids for p in prompts]
    squeezed = LLM(model, block_size=4, num_kv_blocks=20, max_num_batched_tokens=16,
                   quantization=quantization).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in squeezed] == alone
    with pytest.raises(ValueError, match="load it with load_model"):
        LLM(load_model("tiny", device="cpu", weights="random"), num_kv_blocks=8, quantization="int8")


@pytest.mark.parametrize("name", ["llama-3.1-8b", "smollm2-135m", "qwen2.5-0.5b"])
@pytest.mark.parametrize("quantization, group_size", [(None, 32), ("int8", 32), ("int4", 32), ("int4", 128)])
def test_the_ledger_counts_the_bytes_the_layers_hold(name, quantization, group_size):
    """The ledger's formula and the quantized modules built on the meta device agree to the byte."""
    from minillm.engine.model import Transformer
    from minillm.engine.quantization import check_shapes, quantize_model
    from minillm.lab.estimate import weight_bytes

    cfg = load_config(name)
    try:
        check_shapes(cfg, quantization, group_size)
    except ValueError as err:
        assert name == "smollm2-135m" and "group_size=32" in str(err)  # 576 is not a multiple of 128
        return
    with torch.device("meta"):
        model = Transformer(cfg).to(torch.bfloat16)
        if quantization:
            quantize_model(model, quantization, group_size)
    assert weight_bytes(cfg, "bf16", quantization, group_size) == model_bytes(model)


def test_the_24gib_dry_run_holds_twice_the_tokens_with_fp8_kv():
    from minillm.engine.planner import plan

    plans = {(q, kv): plan("llama-3.1-8b", gpu_memory="24GiB", quantization=q, kv_cache_dtype=kv,
                           max_model_len=-1) for q in (None, "int4") for kv in ("auto", "fp8")}
    for q in (None, "int4"):
        bf16, fp8 = plans[(q, "auto")], plans[(q, "fp8")]
        assert fp8.bytes_per_block * 2 == bf16.bytes_per_block
        assert fp8.num_blocks in (2 * bf16.num_blocks, 2 * bf16.num_blocks + 1)
    assert plans[("int4", "auto")].num_blocks > 2 * plans[(None, "auto")].num_blocks
    assert ("weight format", "int4 (groups of 32)") in plans[("int4", "fp8")].rows()


def test_bench_decode_times_the_quantized_model_beside_the_baseline():
    from minillm.lab.bench import bench_decode, format_decode

    result = bench_decode("tiny", "cpu", batches=[1, 2], contexts=[32], steps=2,
                          variants=[("int4", "fp8"), ("int8", "auto")])
    points = result["points"]
    assert [p["variant"] for p in points] == ["baseline", "int4+fp8-kv", "int8"] * 2
    for base, quant, int8 in zip(points[::3], points[1::3], points[2::3]):
        assert quant["speedup"] == base["median_s"] / quant["median_s"]
        assert int8["speedup"] == base["median_s"] / int8["median_s"]
        assert quant["estimate"]["weight_bytes"] < base["estimate"]["weight_bytes"] / 3  # fp32 -> int4
        assert quant["estimate"]["kv_read_bytes"] * 4 == base["estimate"]["kv_read_bytes"]  # fp32 -> fp8
        assert int8["estimate"]["kv_read_bytes"] == base["estimate"]["kv_read_bytes"]
    assert "speedup" in format_decode(result) and "KV cache fp8" in format_decode(result)


@pytest.mark.parametrize("variants, message", [([(None, "auto")], "quantize the weights or the KV cache"),
                                               ([("int4", "auto"), ("int4", "auto")], "repeat"),
                                               ([("int3", "auto")], "quantization must be"),
                                               ([("int8", "fp16")], "kv_cache_dtype")])
def test_bench_decode_refuses_bad_variants_before_loading(variants, message, monkeypatch):
    from minillm.lab import bench

    monkeypatch.setattr(bench, "_setup", lambda *a: pytest.fail("loaded a model for bad variants"))
    with pytest.raises(ValueError, match=message):
        bench.bench_decode("tiny", "cpu", batches=[1], contexts=[32], steps=1, variants=variants)


def test_bench_decode_cli_times_one_variant(capsys):
    from minillm.__main__ import main

    assert main(["bench", "decode", "--model", "tiny", "--device", "cpu", "--batches", "1", "--contexts", "16",
                 "--steps", "1", "--quantization", "int8"]) == 0
    out = capsys.readouterr().out
    assert "int8: weights int8, KV cache auto" in out and "speedup" in out


def test_bench_quality_prints_one_json_object(capsys):
    import json

    from minillm.__main__ import main

    assert main(["bench", "quality", "--quantization", "int4", "--kv-cache-dtype", "fp8", "--tokens", "129",
                 "--window", "64", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 128 and result["model"] == "smollm2-135m"
    assert result["perplexity_ratio"] == result["perplexity"] / result["baseline_perplexity"]
    assert 0.5 < result["top1_agreement"] <= 1 and 1 < result["baseline_perplexity"] < 100


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_stacked_projections_compute_exactly_what_the_separate_ones_do(quantization):
    full = load_model("tiny", device="cpu", weights="random")
    quant = load_model("tiny", device="cpu", weights="random", quantization=quantization)
    layer = Int4Linear if quantization == "int4" else Int8Linear
    x = torch.randn(5, full.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for ours, theirs in zip(quant.model.layers, full.model.layers, strict=True):
        attn, mlp = ours.self_attn, ours.mlp
        assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")  # no copy of the rows
        for stacked, parts in ((attn.project(x), (theirs.self_attn.q_proj, theirs.self_attn.k_proj,
                                                   theirs.self_attn.v_proj)),
                               (mlp.gate_up(x), (theirs.mlp.gate_proj, theirs.mlp.up_proj))):
            for y, linear in zip(stacked, parts, strict=True):
                separate = layer(linear, 32) if quantization == "int4" else layer(linear)
                assert torch.equal(y, separate(x))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_rotating_the_stacked_q_and_k_in_place_is_rotating_each_apart(quantization):
    from minillm.engine.model import apply_rope

    model = load_model("tiny", device="cpu", weights="random", quantization=quantization)
    attn, d = model.model.layers[0].self_attn, model.config.head_dim
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = model.rotary(torch.arange(3, 8), x.dtype)
    q, k, v = attn.rotated_qkv(x, cos, sin)
    apart_q, apart_k, apart_v = (y.reshape(5, -1, d) for y in attn.project(x))
    assert torch.equal(q, apply_rope(apart_q, cos, sin)) and torch.equal(k, apply_rope(apart_k, cos, sin))
    assert torch.equal(v, apart_v) and not torch.equal(q, apart_q)
