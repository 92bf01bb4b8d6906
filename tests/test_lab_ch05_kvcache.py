"""The kit of chapter 5 (KV cache): the page's ledger of Llama-3.1-8B (the seed figures of the KV,
both ways of making the next token under max(F/P, M/W)), and the lab's measurements of what a
cache really allocates and leaves empty."""
import pytest
import torch

from minillm.engine.config import load_config
from minillm.engine.loader import load_model
from minillm.lab import estimate as L
from minillm.lab.chapters import ch05_kvcache as kit
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
    assert s.ts == [8, 32] and all(t > 0 for t in (*s.cached.values(), *s.recompute.values()))
    g = kit.time_gqa_mha(tiny, [(1, 16)], 1e11, 4e10, steps=1)
    assert g.points == [(1, 16)] and g.floor("MHA", (1, 16)).bytes > g.floor("GQA", (1, 16)).bytes
