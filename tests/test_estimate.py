"""Every figure of DESIGN.md's "Figures the seeds derive", recomputed by the ledger."""
import json

import pytest

from minillm.engine.config import ModelConfig, load_config
from minillm.lab import estimate as L
from minillm.lab.estimate import (GB, GiB, KiB, attention_flops_per_token, decode_step, fmt_int,
                              kv_bytes, kv_bytes_per_token, matmul_flops_per_token,
                              matmul_param_count, memory_budget, paged_waste_tokens, param_count,
                              parse_size, preallocation_waste, prefill, ridge_point, roofline_floor,
                              weight_bytes)

TB_S = 1e12


@pytest.fixture(scope="module")
def llama8b():
    return load_config("llama-3.1-8b")


def test_llama8b_parameters_and_weights(llama8b):
    assert param_count(llama8b) == 8_030_261_248
    assert fmt_int(param_count(llama8b)) == "8,030,261,248"
    assert round(weight_bytes(llama8b, "bf16") / GB, 2) == 16.06
    assert round(weight_bytes(llama8b, "bf16") / GiB, 2) == 14.96
    assert round(matmul_param_count(llama8b) / 1e9, 3) == 7.505
    assert round(matmul_flops_per_token(llama8b) / 1e9, 2) == 15.01


@pytest.mark.parametrize("ctx,gflop", [(1024, 0.537), (4096, 2.147), (8192, 4.295)])
def test_attention_flops(llama8b, ctx, gflop):
    assert round(attention_flops_per_token(llama8b, ctx) / 1e9, 3) == gflop


@pytest.mark.parametrize("n,intensity", [(512, 478), (2048, 1914)])
def test_prefill_intensity_is_about_n(llama8b, n, intensity):
    """Every token through every matrix, 2 FLOPs per 2-byte weight: about n FLOP per weight byte."""
    assert round(n * matmul_flops_per_token(llama8b) / weight_bytes(llama8b)) == intensity


def test_prefill_counts_the_output_layer_once_per_sequence(llama8b):
    """The engine computes logits only at each sequence's last position."""
    one, eight = prefill(llama8b, 512), prefill(llama8b, 512, sequences=8)
    head = 2 * llama8b.vocab_size * llama8b.hidden_size
    assert one.linear_flops == 512 * (matmul_flops_per_token(llama8b) - head) + head
    assert eight.linear_flops - one.linear_flops == 7 * head
    assert eight.attention_flops < one.attention_flops  # eight short causal triangles
    assert one.intensity == one.flops / one.bytes < 512 * matmul_flops_per_token(llama8b) / weight_bytes(llama8b)


def test_one_floor_names_its_binding_ceiling(llama8b):
    """max(F / P, M / W): prefill of 2,048 tokens is compute-bound on an H100-like card, a decode
    step at B=1 memory-bound; the floor is never below either side."""
    P, W = 989e12, 3.35e12
    pre = prefill(llama8b, 2048).floor(P, W)
    dec = decode_step(llama8b, 1, 1024, W).floor(P)
    assert (pre.bound, dec.bound) == ("compute", "memory")
    for f in (pre, dec):
        assert f.seconds == max(f.flops / P, f.bytes / W) and f.share_of(2 * f.seconds) == 0.5
    with pytest.raises(ValueError):
        roofline_floor(1.0, 0.0, P, W)


@pytest.mark.parametrize("batch,gb,ms,tok_s", [(1, 16.19, 16.19, "62"), (16, 18.21, 18.21, "879"),
                                                (48, 22.50, 22.50, "2,133")])
def test_decode_floor_at_1tb_s(llama8b, batch, gb, ms, tok_s):
    step = decode_step(llama8b, batch, 1024, TB_S)
    assert round(step.bytes / GB, 2) == gb
    assert round(step.time_floor * 1e3, 2) == ms
    assert fmt_int(step.tokens_per_s) == tok_s
    assert step.kv_intensity == 4.0  # n_h / n_kv, whatever the batch


def test_decode_intensity_grows_with_batch(llama8b):
    assert [round(decode_step(llama8b, b, 1024, TB_S).intensity, 1) for b in (1, 16, 48)] == [1.0, 13.7, 33.2]


def test_kv_per_token_and_per_request(llama8b):
    assert kv_bytes_per_token(llama8b, "bf16") == 131072 == 128 * KiB
    assert kv_bytes_per_token(llama8b.replace(num_kv_heads=32)) == 512 * KiB
    assert [kv_bytes(llama8b, c) / GiB for c in (1024, 4096, 8192, 131072)] == [0.125, 0.5, 1, 16]


def test_24gib_budget(llama8b):
    budget = memory_budget(llama8b, "24GiB", 0.92)
    assert round(budget.budget_bytes / GiB, 2) == 22.08
    assert round(budget.kv_budget_bytes / GiB, 2) == 7.12
    assert fmt_int(budget.token_capacity) == "58,347" and budget.tokens == 58_347
    assert [round(budget.requests_at(c), 1) for c in (1024, 4096, 8192)] == [57.0, 14.2, 7.1]
    assert [budget.concurrent_requests(c) for c in (1024, 4096, 8192)] == [56, 14, 7]  # whole requests
    assert kv_bytes(llama8b, 131072) > budget.kv_budget_bytes  # a full-length request cannot fit
    assert budget.source == "ledger" and budget.activation_peak_bytes == budget.other_bytes == 0


def test_mha_variant_same_leftover(llama8b):
    budget = memory_budget(llama8b, "24GiB", 0.92)
    mha = llama8b.replace(num_kv_heads=llama8b.num_heads)
    mha_budget = memory_budget(llama8b, "24GiB", 0.92, kv_config=mha)
    assert mha_budget.kv_budget_bytes == budget.kv_budget_bytes  # same weights, same leftover
    assert fmt_int(mha_budget.token_capacity) == "14,587" and mha_budget.tokens == 14_586
    assert decode_step(mha, 1, 1024, TB_S).kv_intensity == 1.0


def test_preallocation_waste():
    assert preallocation_waste(8192, 1024) == 0.875
    assert paged_waste_tokens([1024, 17, 16], 16) == 15
    with pytest.raises(ValueError):
        preallocation_waste(1024, 2048)


def test_generic_7b_of_chapter_one():
    """7 B parameters in fp16, 32 layers, 32 KV heads, head dim 128, 8K input."""
    llama2 = load_config("llama-2-7b")
    nominal_weights = 7e9 * 2
    assert round(nominal_weights / GB) == 14 and round(nominal_weights / GiB) == 13
    per_request = kv_bytes(llama2, 8192, "fp16")
    assert kv_bytes_per_token(llama2, "fp16") == 512 * KiB and per_request == 4 * GiB
    assert round((nominal_weights + per_request) / GiB) == 17
    assert round((nominal_weights + 8 * per_request) / GiB) == 45
    assert round(nominal_weights / 2039e9 * 1e3, 1) == 6.9  # A100 80GB
    assert round(nominal_weights / 3350e9 * 1e3, 1) == 4.2  # H100 SXM


def test_unseen_config_matches_hand_count(tmp_path):
    """A Qwen2-style config with biases and tied embeddings, counted by hand."""
    hf = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = load_config(tmp_path)
    d, kv = 16, 32
    per_layer = (64 * 64 + 64) + 2 * (64 * kv + kv) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert param_count(cfg) == 1000 * 64 + 3 * per_layer + 64
    assert cfg.head_dim == d


def test_qwen3_head_dim_and_qk_norm():
    cfg = load_config("qwen3-0.6b")
    assert cfg.head_dim == 128 and cfg.head_dim * cfg.num_heads != cfg.hidden_size
    assert param_count(cfg) == 596_049_920  # hand count; 0.44 B without embeddings, as published


def test_parse_size_and_errors():
    assert parse_size("24GiB") == 24 * GiB and parse_size("80GB") == 80 * GB
    assert parse_size("512MiB") == 512 * 2**20
    for bad in ("-3GiB", "abc", "0GiB", "3 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="utilization"):
        memory_budget(load_config("tiny"), "24GiB", 1.5)


def test_prefill_crossover_sits_near_the_ridge(llama8b):
    from minillm.lab.estimate import prefill_crossover
    from minillm.lab.gpus import lookup_gpu
    h100 = lookup_gpu("H100 SXM")
    n = prefill_crossover(llama8b, h100.bf16_flops, h100.bandwidth)
    assert n == 339  # above the ridge (295 FLOP/byte): the output layer runs once, not per token
    before, at = prefill(llama8b, n - 1), prefill(llama8b, n)
    assert before.flops / h100.bf16_flops < before.bytes / h100.bandwidth
    assert at.flops / h100.bf16_flops >= at.bytes / h100.bandwidth


def test_ridge_point():
    assert ridge_point(989e12, 3.35e12) == pytest.approx(295.2, abs=0.1)


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(name="x", model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4, max_position_embeddings=8)


def test_config_rejects_sliding_window_attention():
    hf = {"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32768,
          "sliding_window": 4096}
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_dict(hf)
    assert ModelConfig.from_dict({**hf, "sliding_window": None}).num_kv_heads == 2


def test_decode_stays_bandwidth_bound_on_the_h100_at_long_context(llama8b):
    """Chapter 解码: however large the batch, 8B decode at c = 1024 or 8192 stays under the H100's
    ridge, and from about 393 tokens of context on no batch crosses it."""
    from minillm.lab.gpus import lookup_gpu

    ridge = lookup_gpu("H100 SXM").ridge_point
    assert [round(L.decode_intensity_limit(llama8b, c)) for c in (1024, 8192)] == [116, 18]
    c = L.decode_always_bandwidth_bound_from(llama8b, ridge)
    assert round(c) == 393
    assert L.decode_intensity_limit(llama8b, int(c) + 1) < ridge < L.decode_intensity_limit(llama8b, int(c) - 1)
    assert L.decode_step(llama8b, 4096, 1024, 3.35e12).floor(lookup_gpu("H100 SXM").bf16_flops).bound == "memory"


def test_the_decode_chapter_reads_its_card_table_right(llama8b):
    """What chapter 解码 says of its card table at c = 1024: a 24 GiB card at its largest batch takes
    about half as long again as at B = 1 for dozens of times the throughput (and so does B = 48 on
    the made-up 1 TB/s card); the 80 GiB and larger cards hold hundreds of requests, and KV is most
    of their step's bytes; every floor is M/W."""
    from minillm.lab.gpus import lookup_gpu

    def at(spec, batch):
        return decode_step(llama8b, batch, 1024, spec.bandwidth)

    def largest(spec):
        return memory_budget(llama8b, spec.memory_bytes, 0.92).concurrent_requests(1024)

    for name in ("RTX 4090", "A10", "L4"):  # the table's 24 GiB cards
        card = lookup_gpu(name)
        b = largest(card)
        assert card.memory_gib == 24 and b == 56
        assert round(at(card, b).time_floor / at(card, 1).time_floor, 2) == 1.46
        assert 20 < (b / at(card, b).time_floor) / (1 / at(card, 1).time_floor) < 100
    made_up = {batch: decode_step(llama8b, batch, 1024, TB_S) for batch in (1, 48)}
    assert made_up[48].time_floor < 1.5 * made_up[1].time_floor  # "less than half as long again"
    assert made_up[48].tokens_per_s > 20 * made_up[1].tokens_per_s  # "dozens of times"
    for name in ("A100 80GB SXM", "H100 SXM", "H200"):
        spec = lookup_gpu(name)
        step = at(spec, largest(spec))
        assert largest(spec) >= 200 and step.kv_read_bytes / step.bytes > 0.5
    for name in ("A100 80GB SXM", "H100 SXM", "H200", "RTX 4090", "A10", "L4"):
        spec = lookup_gpu(name)
        for batch in (1, largest(spec)):
            assert at(spec, batch).floor(spec.bf16_flops).bound == "memory"


def test_the_decode_chapter_exercises(llama8b):
    """Chapter 解码, exercises 1-3: at 4K on the H100 memory binds before a 30 ms TPOT does; without
    GQA KV is most of a B = 32 step and reads at 1 FLOP/byte; fp8 weights nearly halve a B = 1 step
    and help a B = 64 step a little."""
    from minillm.lab.gpus import lookup_gpu

    h100 = lookup_gpu("H100 SXM")
    b_bw = int((0.030 * h100.bandwidth - weight_bytes(llama8b)) // kv_bytes(llama8b, 4096))
    b_mem = memory_budget(llama8b, h100.memory_bytes, 0.92).concurrent_requests(4096)
    assert (b_bw, b_mem) == (157, 117)
    mha = decode_step(llama8b.replace(num_kv_heads=32), 32, 4096, h100.bandwidth)
    assert mha.kv_read_bytes / mha.bytes > 0.75 and mha.kv_intensity == 1
    speedup = [decode_step(llama8b, b, 4096, h100.bandwidth).time_floor /
               decode_step(llama8b, b, 4096, h100.bandwidth, dtype="fp8", kv_dtype="bf16").time_floor for b in (1, 64)]
    assert [round(s, 2) for s in speedup] == [1.94, 1.19]
    b64 = decode_step(llama8b, 64, 4096, h100.bandwidth)
    assert b64.kv_read_bytes / b64.bytes > 0.5  # at B = 64 KV is most of the step, even in bf16


# --- What chapter 为什么服务大模型难 says of its ledger --------------------------------------------

def test_the_ledger_chapter_on_attention_and_prefill(llama8b):
    """Attention is a fifth of a token's FLOPs at 8K, half at 32K, and equals the linear layers at
    about 28.6K; the engine's prefill count sits a few percent under the rule of thumb, above every
    card's ridge, and from 480 prompt tokens on prefill is compute-bound on every card."""
    from minillm.lab.gpus import gpu_specs

    linear = matmul_flops_per_token(llama8b)
    share = {c: attention_flops_per_token(llama8b, c) / (attention_flops_per_token(llama8b, c) + linear)
             for c in (8192, 32768)}
    assert (f"{share[8192]:.1%}", f"{share[32768]:.1%}") == ("22.2%", "53.4%")
    cross = linear / attention_flops_per_token(llama8b, 1)
    assert round(cross) == 28_628 and attention_flops_per_token(llama8b, 28_629) > linear
    specs = gpu_specs()
    for n, engine in ((512, 447), (2048, 1818)):
        rule = n * linear / weight_bytes(llama8b)
        assert round(prefill(llama8b, n).intensity) == engine and 0.9 < engine / rule < 1
        assert engine > max(s.ridge_point for s in specs)
    n = max(L.prefill_crossover(llama8b, s.bf16_flops, s.bandwidth) for s in specs)
    assert n == 480
    assert all(prefill(llama8b, n).floor(s.bf16_flops, s.bandwidth).bound == "compute" for s in specs)
    assert any(prefill(llama8b, n - 1).floor(s.bf16_flops, s.bandwidth).bound == "memory" for s in specs)


def test_the_ledger_chapter_on_ridges_and_the_made_up_card(llama8b):
    """The spec table's ridges run from tens to hundreds of FLOP per byte (the RTX 3090's 76 to the
    L40S's 419); on a 1 TB/s card with the lowest of them, decode at B = 1, 16, 48 is bandwidth-bound
    and at B = 48 KV is 29% of the bytes."""
    from minillm.lab.gpus import gpu_specs

    specs = sorted(gpu_specs(), key=lambda s: s.ridge_point)
    assert (specs[0].name, round(specs[0].ridge_point)) == ("RTX 3090", 76)
    assert (specs[-1].name, round(specs[-1].ridge_point)) == ("L40S", 419)
    for batch in (1, 16, 48):
        assert decode_step(llama8b, batch, 1024, TB_S).floor(specs[0].ridge_point * TB_S).bound == "memory"
    step = decode_step(llama8b, 48, 1024, TB_S)
    assert f"{step.kv_read_bytes / step.bytes:.0%}" == "29%"


def test_the_ledger_chapter_on_the_24gib_card(llama8b):
    """GB and GiB differ by 6.9%; pre-allocating 8K per request holds 7 requests where 1K each would
    hold 56; real "24 GB" cards report less, the A10 (ECC) least, and lose KV room for it."""
    from minillm.lab.vllm_logs import reported_memory

    assert f"{1 - GB / GiB:.1%}" == "6.9%"
    budget = memory_budget(llama8b, "24GiB", 0.92)
    assert int(budget.kv_budget_bytes // kv_bytes(llama8b, 8192)) == 7 and budget.tokens // 1024 == 56
    lost = {g: 1 - memory_budget(llama8b, reported_memory(g), 0.92).token_capacity / budget.token_capacity
            for g in ("RTX 4090", "RTX 3090", "A10")}
    assert all(share > 0 for share in lost.values()) and max(lost, key=lost.get) == "A10"
    assert (f"{lost['RTX 4090']:.0%}", f"{lost['A10']:.0%}") == ("5%", "25%")


def test_the_ledger_chapter_exercises(llama8b):
    """1: without GQA the same leftover holds a quarter of the tokens and a real MHA model fewer
    still; 2: on an H100 KV holds 480,399 tokens and a B = 1 step is bandwidth-bound by two orders
    of magnitude; 3: Qwen2.5-7B's KV per token is under half Llama's, so it holds more than twice
    the 8K requests."""
    from minillm.lab.gpus import lookup_gpu

    mha = llama8b.replace(num_kv_heads=llama8b.num_heads)
    same = memory_budget(llama8b, "24GiB", 0.92, kv_config=mha)
    real = memory_budget(mha, "24GiB", 0.92)
    assert round(same.token_capacity) == 14_587 and round(real.token_capacity) == 11_515
    h100 = lookup_gpu("H100 SXM")
    assert memory_budget(llama8b, h100.memory_bytes, 0.92).tokens == 480_399
    step = decode_step(llama8b, 1, 1024, h100.bandwidth).floor(h100.bf16_flops)
    assert step.bound == "memory" and step.memory_seconds > 100 * step.compute_seconds
    qwen = load_config("qwen2.5-7b")
    assert kv_bytes_per_token(qwen) < kv_bytes_per_token(llama8b) / 2
    assert (memory_budget(qwen, "24GiB", 0.92).requests_at(8192)
            > 2 * memory_budget(llama8b, "24GiB", 0.92).requests_at(8192))


def test_the_ledger_chapter_roofline_figure(llama8b):
    """On the H100's roofline the 8B's decode at c = 1024 (B = 1, 16, 256) sits on the slope and its
    prefill from n = 512 on the flat top."""
    from minillm.lab.gpus import lookup_gpu

    h100 = lookup_gpu("H100 SXM")
    for batch in (1, 16, 256):
        assert decode_step(llama8b, batch, 1024, h100.bandwidth).intensity < h100.ridge_point
    assert [prefill(llama8b, n).intensity > h100.ridge_point for n in (1, 16, 512, 8192)] == [False, False, True, True]


def test_the_life_chapter_reads_its_ledger_right(llama8b):
    """What chapter 一次请求的一生 says of its generic 7B (Llama-2-7B's shape, nominal 14 GB in fp16)
    and its 8K contract: which cards hold one, eight and twenty requests; that decode is bandwidth-
    bound on the A100, H100 and H200 and a batch of eight spreads the weights but not the KV; that
    GQA, 32K contexts and 70B move the walls; and its exercises' shapes."""
    from minillm.lab.gpus import gpu_specs, lookup_gpu

    cfg7, weights, ctx = load_config("llama-2-7b"), 7e9 * 2, 8192
    assert (cfg7.num_layers, cfg7.num_kv_heads, cfg7.head_dim, cfg7.max_position_embeddings) == (32, 32, 128, 4096)
    kv = kv_bytes(cfg7, ctx, "fp16")
    usable = {gib: lookup_gpu(name).memory_bytes * 0.92 for gib, name in ((24, "RTX 4090"), (48, "L40S"), (80, "A100 80GB SXM"))}
    fits = {gib: int((room - weights) // kv) for gib, room in usable.items()}
    assert weights + kv <= usable[24] and fits == {24: 2, 48: 7, 80: 15}  # eight fit 80 GiB only
    assert 20 * kv == 80 * GiB and weights + 20 * kv > usable[80]
    assert kv_bytes(cfg7, 32768, "fp16") == 16 * GiB and weights + 16 * GiB > usable[24]
    assert -(-70e9 * 2 // usable[80]) == 2  # a 70B in fp16 needs two 80 GiB cards

    def decode7(batch, context, spec):
        flops = batch * (2 * 7e9 + attention_flops_per_token(cfg7, context))
        return roofline_floor(flops, weights + batch * kv_bytes(cfg7, context, "fp16"), spec.bf16_flops, spec.bandwidth)

    assert [round(lookup_gpu(n).bandwidth_gb_s) for n in ("A100 80GB SXM", "H100 SXM")] == [2039, 3350]
    for name in ("A100 80GB SXM", "H100 SXM", "H200"):
        spec = lookup_gpu(name)
        alone, one, eight = decode7(1, 1, spec), decode7(1, ctx, spec), decode7(8, ctx, spec)
        assert all(f.bound == "memory" for f in (alone, one, eight)) and alone.compute_seconds < 50e-6
        assert 8 * kv > weights and 2 < eight.seconds / one.seconds < 3  # eight KVs outweigh the weights
        assert 2 < (8 / eight.seconds) / (1 / one.seconds) < 5  # "a few times" the throughput
    h200 = lookup_gpu("H200")
    assert decode7(8, ctx, h200).seconds / decode7(1, 1, h200).seconds > 3  # exercise 2
    assert round(ctx * (ctx - 1) / (1024 * 1023)) == 64  # exercise 3: 8x longer, ~64x the recomputation
    # The contract in English and in Chinese (8K to about 17K tokens) prefills compute-bound on the A100
    a100 = lookup_gpu("A100 80GB SXM")
    assert all(prefill(cfg7, n, "fp16").floor(a100.bf16_flops, a100.bandwidth).bound == "compute"
               for n in (8192, 16384, 20000))
    # The lab's timings (SmolLM2 in fp32 on the CPU, the 8B in bf16 on a GPU): the contract's prefill does
    # hundreds to thousands of FLOPs per byte, the decodes of section 5 a few tenths to a few; short
    # contexts, a batch of 16 does nearly 16 times the FLOPs per byte of one request
    smol = load_config("smollm2-135m")
    assert 100 < prefill(smol, 1024, "float32").intensity < 1000 < prefill(llama8b, 8192).intensity < 10_000
    decodes = [decode_step(smol, 1, 80, TB_S, "float32"), decode_step(smol, 4, 2 * 1024 + 8, TB_S, "float32"),
               decode_step(llama8b, 1, 80, TB_S), decode_step(llama8b, 4, 2 * 8192 + 64, TB_S)]
    assert 0.1 < min(d.intensity for d in decodes) < 1 < max(d.intensity for d in decodes) < 10
    assert decode_step(smol, 16, 100, TB_S, "float32").intensity > 12 * decode_step(smol, 1, 100, TB_S, "float32").intensity
    # GQA: a quarter of the 7B's KV per token; 29 8K requests on a 48 GiB card
    assert llama8b.gqa_ratio == 4 and kv_bytes(llama8b, ctx) * 4 == kv
    assert memory_budget(llama8b, lookup_gpu("L40S").memory_bytes, 0.92).concurrent_requests(ctx) == 29
    # One long prompt against eight pieces: about 8x the attention; in the 8B's 8K prefill attention is small
    for model in (llama8b, load_config("smollm2-135m")):
        for n in (1024, 8192):
            assert 7.5 < prefill(model, n).attention_flops / prefill(model, n, sequences=8).attention_flops <= 8
    assert 0.1 < prefill(llama8b, ctx).attention_flops / prefill(llama8b, ctx).flops < 0.2  # "一成多"
    # Sixteen users decoding short answers stay bandwidth-bound on every GPU of the table
    assert all(decode_step(llama8b, 16, 128, s.bandwidth).floor(s.bf16_flops).bound == "memory" for s in gpu_specs())
