"""The kit of chapter 5 (KV cache): the page's ledger of Llama-3.1-8B (the seed figures of the KV,
both ways of making the next token under max(F/P, M/W)), and the lab's measurements of what a
cache really allocates and leaves empty."""
import pytest
import torch

from minillm.engine.config import load_config
from minillm.engine.loader import load_model
from minillm.lab import estimate as L
from minillm.lab.chapters import ch05_kvcache as kit
from minillm.lab.claims import STRICT, ClaimError, floors_beaten
from minillm.lab.gpus import lookup_gpu


@pytest.fixture(scope="module")
def numbers():
    return kit.page_numbers()


def test_the_seed_figures_of_the_kv(numbers):
    assert (numbers["kv_per_token"], numbers["kv_per_token_kib"], numbers["kv_mha_kib"]) == ("131,072", "128 KiB", "512 KiB")
    assert [numbers[f"kv_req_{c}"] for c in (1024, 4096, 8192, 131072)] == ["0.125 GiB", "0.5 GiB", "1 GiB", "16 GiB"]
    assert (numbers["tokens_fit"], numbers["tokens_fit_mha_same"], numbers["left_gib"]) == ("58,347", "14,587", "7.12 GiB")
    assert (numbers["waste"], numbers["fit_prealloc"], numbers["fit_actual"], numbers["conc_used"]) == ("87.5%", "7", "56", "57.0")


def test_cached_steps_are_bandwidth_bound_recomputed_steps_compute_bound(numbers):
    assert numbers["h100_cached"] == "≥ 5.11 ms（带宽：M/W）"
    assert numbers["h100_recompute"] == "≥ 133.34 ms（算力：F/P）"
    assert (numbers["h100_time_ratio"], numbers["h100_t_over_ridge"], numbers["h100_batch_ratio"]) == ("26", "28", "215")
    assert numbers["flop_ratio_8192"] == "6,835" and numbers["gen_ratio"] == "735"
    cfg, h100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")
    again = kit.step_floor(cfg, 100, False, h100.bf16_flops, h100.bandwidth)
    assert again.flops == L.prefill(cfg, 100).flops  # recomputing is a prefill of the whole sequence


def test_a_whole_generation_sums_its_steps():
    cfg, h100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")
    P, W = h100.bf16_flops, h100.bandwidth
    flops, seconds = kit.generation_floors(cfg, 10, 3, True, P, W)
    steps = [kit.step_floor(cfg, 10, False, P, W), kit.step_floor(cfg, 11, True, P, W), kit.step_floor(cfg, 12, True, P, W)]
    assert flops == sum(f.flops for f in steps) and seconds == pytest.approx(sum(f.seconds for f in steps))


def test_exercises(numbers):
    assert (numbers["ex1_qwen_kib"], numbers["ex1_qwen_32k"]) == ("56 KiB", "1.75 GiB")
    assert (numbers["ex2_cached"], numbers["ex2_recompute"]) == ("4.98 s", "22.85 s")
    assert (numbers["ex3_fp8_tokens"], numbers["ex3_fp8_8k"]) == ("116,694", "14.2")
    assert (numbers["mha_ratio_1"], numbers["mha_ratio_16"]) == ("1.19", "2.11")


def test_measured_kv_per_token_matches_the_ledger():
    llama, smol = load_config("llama-3.1-8b"), load_config("smollm2-135m")
    assert kit.measured_kv_per_token(llama, torch.bfloat16, "meta") == L.kv_bytes_per_token(llama) == 131072
    assert kit.measured_kv_per_token(smol, torch.float32, "cpu", tokens=8) == L.kv_bytes_per_token(smol, "fp32")


def test_the_mha_variant_has_a_kv_head_per_query_head():
    smol = load_config("smollm2-135m")
    mha = kit.mha_variant(smol)
    assert mha.num_kv_heads == smol.num_heads and mha.name == "smollm2-135m-mha"
    assert L.kv_bytes_per_token(mha) == smol.gqa_ratio * L.kv_bytes_per_token(smol)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny", device="cpu", dtype=torch.float32, weights="random")


def test_contiguous_waste_counts_the_written_positions(tiny):
    w = kit.contiguous_waste(tiny, requests=4, max_len=128)
    assert w.written == w.lengths and len(w.lengths) == 4
    assert w.measured == pytest.approx(w.estimate)
    assert w.reserved_bytes == 4 * 128 * L.kv_bytes_per_token(tiny.config, "fp32")


def test_the_two_ways_and_gqa_beside_mha(tiny):
    s = kit.time_steps(tiny, (8, 32), 1e11, 4e10, steps=1)
    assert s.ts == [8, 32] and all(t > 0 for t in (*s.cached.values(), *s.recompute.values(), *s.linear.values()))
    assert sorted(s.linear) == [1, 8, 32]  # the cached step's one row, each recompute's t rows
    g = kit.time_gqa_mha(tiny, [(1, 16), (1, 32)], 1e11, 4e10, steps=1)
    assert g.points == [(1, 16), (1, 32)] and g.floor("MHA", (1, 16)).bytes > g.floor("GQA", (1, 16)).bytes
    assert {name: sorted(by_batch) for name, by_batch in g.linear.items()} == {"GQA": [1], "MHA": [1]}


P, W = 1e11, 4e10  # a synthetic machine: ridge 2.5 FLOP/byte


def synthetic(cached_share: float, recompute_share: float, gqa_share: float):
    """Steps and GQA/MHA points of SmolLM2 in fp32 timed at ``share`` of each floor, the linear
    layers alone at twice the probed matmul rate and twice the probed copy."""
    smol = load_config("smollm2-135m")
    c, r = kit.step_floor(smol, 24, True, P, W, "float32"), kit.step_floor(smol, 24, False, P, W, "float32")
    linear = {1: L.matmul_weight_bytes(smol, 1, "fp32") / (2 * W), 24: L.prefill(smol, 24, "fp32").linear_flops / (2 * P)}
    s = kit.Steps(smol, "float32", P, W, {24: cached_share * c.seconds}, {24: recompute_share * r.seconds}, linear)
    g = kit.GqaMha(smol, "float32", P, W, {"GQA": {}, "MHA": {}}, {"GQA": {}, "MHA": {}})
    for name in ("GQA", "MHA"):
        g.times[name][2, 256] = gqa_share * g.floor(name, (2, 256)).seconds
        g.linear[name][2] = L.matmul_weight_bytes(g.config(name), 2, "fp32") / (2 * W)
    return s, g


def test_every_step_at_or_above_its_floor_needs_no_why():
    s, g = synthetic(1.0, 1.5, 1.2)
    assert (s.floor(24, True).bound, s.floor(24, False).bound, g.floor("MHA", (2, 256)).bound) == ("memory", "compute", "memory")
    assert s.why(24, True) is None and s.why(24, False) is None and g.why("GQA", (2, 256)) is None
    assert floors_beaten(kit.floor_checks(s, g)) == []


def test_a_step_that_beats_its_floor_names_the_rates():
    s, g = synthetic(0.5, 0.8, 1.0)
    assert s.why(24, False) == "重算 t = 24 个 token 时，模型自己的线性层跑出 200.0 GFLOP/s，高于方阵探测的 100.0 GFLOP/s"
    assert s.why(24, True) == ("带 cache、t = 24 时，线性层读权重的速度 80.0 GB/s，高于拷贝探测的 40.0 GB/s"
                               "（拷贝要读也要写，这里只读）")
    assert floors_beaten(kit.floor_checks(s, g)) == [s.why(24, True), s.why(24, False)]


def test_a_beaten_floor_nothing_explains_fails_the_claim(monkeypatch):
    s, g = synthetic(1.0, 1.0, 0.5)
    g.linear = {name: {2: 4 * seconds[2]} for name, seconds in g.linear.items()}  # now at half the copy
    assert g.why("GQA", (2, 256)) is None
    monkeypatch.setenv(STRICT, "1")
    with pytest.raises(ClaimError, match="下界"):
        floors_beaten(kit.floor_checks(s, g))
    monkeypatch.setenv(STRICT, "0")
    assert floors_beaten(kit.floor_checks(s, g)) == [None, None]


def test_ratio_words_name_the_weight_read_only_when_it_was_slow():
    assert kit.ratio_words(20.0, 40.0, True).endswith("固定开销和读权重的低效把它垫高了。")
    assert kit.ratio_words(20.0, 40.0, False).endswith("每步的固定开销把它垫高了。")
    assert kit.ratio_words(50.0, 40.0, True).startswith("实测之比不小于下界之比：重算的一步离下界更远")


def test_mha_words_name_the_weight_read_only_when_it_was_slow():
    assert kit.mha_words(1.1, 1.5, True, False) == "实测之比小于下界之比：两者共有的固定开销和读权重的低效把倍数往 1 拉。"
    assert kit.mha_words(1.1, 1.5, False, True) == "实测之比小于下界之比：两者共有的每步固定开销把倍数往 1 拉。"
    assert kit.mha_words(2.0, 1.5, True, False).startswith("实测之比不小于下界之比：CPU 的参考实现")
    assert kit.mha_words(2.0, 1.5, False, True).endswith("注意力 kernel 读 KV 的效率在一步里越要紧。")


def test_gqa_mha_linear_rates():
    s, g = synthetic(1.0, 1.0, 1.0)
    assert g.linear_rates("MHA", 2)[1] == pytest.approx(2 * W)
    assert g.linear_rates("GQA", 2)[0] == pytest.approx(2 * L.matmul_flops_per_token(g.cfg) / g.linear["GQA"][2])
