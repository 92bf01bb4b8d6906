"""Chapter 预填充 (book/ch03-prefill.md): what its page says of Llama-3.1-8B on the spec cards,
recomputed by the ledger, and the ledger of a chunk of a prompt (exercise 3, and chapter 调度)."""
import pytest

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.gpus import gpu_specs, lookup_gpu

LLAMA, H100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")


def on_card(cfg, n, spec, dtype="bf16"):
    return L.prefill(cfg, n, dtype).floor(spec.bf16_flops, spec.bandwidth)


def test_a_short_question_reads_a_long_contract_computes():
    short, long, one = on_card(LLAMA, 16, H100), on_card(LLAMA, 8192, H100), on_card(LLAMA, 1, H100)
    assert (short.bound, round(short.seconds * 1e3, 2)) == ("memory", 4.79)
    assert (long.bound, round(long.seconds * 1e3, 2)) == ("compute", 133.34)
    assert round(long.seconds / short.seconds) == 28
    assert (round(one.memory_seconds * 1e3, 2), round(one.compute_seconds * 1e6)) == (4.79, 15)
    # "几千 token 的 prompt，算的时间远超读的时间"
    at_2048 = on_card(LLAMA, 2048, H100)
    assert at_2048.compute_seconds > 5 * at_2048.memory_seconds


def test_the_layers_cap_how_many_tokens_a_second_a_card_prefills():
    """"每个 token 至少要做各层那 13.96 GFLOP，所以这张卡每秒最多预填充 70,888 个 token"."""
    layers = L.matmul_flops_per_token(LLAMA) - L.output_layer_flops(LLAMA)
    cap = H100.bf16_flops / layers
    assert round(cap) == 70888
    assert all(n / on_card(LLAMA, n, H100).seconds < cap for n in (1, 512, 8192, 131072))


def test_the_engine_bills_the_output_layer_once():
    per_token = L.matmul_flops_per_token(LLAMA)
    assert round(512 * per_token / L.weight_bytes(LLAMA)) == 478  # the seed's rule of thumb
    assert round(L.prefill(LLAMA, 512).intensity) == 447  # as the engine computes it
    assert [round(x / 1e9, 2) for x in (per_token - L.output_layer_flops(LLAMA), L.output_layer_flops(LLAMA),
                                        per_token)] == [13.96, 1.05, 15.01]
    assert round(L.attention_flops_per_token(LLAMA, 1) / 1e6, 3) == 0.524


def test_prefill_moves_mostly_weights():
    e = L.prefill(LLAMA, 8192)
    assert e.kv_write_bytes == 2**30 and e.kv_write_bytes / e.bytes < 0.07


def test_attention_takes_over_only_at_tens_of_thousands():
    """"几千 token 以内它是小头，32K 时已超过三分之一，128K 时占了大半"."""
    share = {n: L.prefill(LLAMA, n).attention_flops / L.prefill(LLAMA, n).flops for n in (2048, 8192, 32768, 131072)}
    assert share[2048] < 0.05 and [round(share[n], 2) for n in (8192, 32768, 131072)] == [0.13, 0.38, 0.71]
    assert share[32768] > 1 / 3 and share[131072] > 1 / 2


def test_every_card_crosses_over_about_15_percent_above_its_ridge():
    cross = {s.name: L.prefill_crossover(LLAMA, s.bf16_flops, s.bandwidth) for s in gpu_specs()}
    assert (cross["H100 SXM"], round(H100.ridge_point)) == (339, 295)
    assert all(1.14 < cross[s.name] / s.ridge_point < 1.17 for s in gpu_specs())
    assert (min(cross.values()), max(cross.values())) == (88, 480)


def test_exercise_1_the_contract_on_two_cards_is_compute_bound():
    rtx = lookup_gpu("RTX 4090")
    floors = {(s.name, n): on_card(LLAMA, n, s) for s in (rtx, H100) for n in (8192, 32768)}
    assert all(f.bound == "compute" for f in floors.values())
    for n in (8192, 32768):  # the floors' ratio is the compute rates' ratio, not the bandwidths'
        ratio = floors["RTX 4090", n].seconds / floors["H100 SXM", n].seconds
        assert ratio == pytest.approx(H100.bf16_flops / rtx.bf16_flops)
        assert f"{ratio:.2f}" != f"{H100.bandwidth / rtx.bandwidth:.2f}"
    assert floors["H100 SXM", 32768].seconds > 4 * floors["H100 SXM", 8192].seconds


def test_exercise_2_the_crossover_barely_depends_on_the_model():
    P, W = H100.bf16_flops, H100.bandwidth
    cross = {name: (L.prefill_crossover(load_config(name), P, W), L.prefill_crossover(load_config(name), P, W, "fp8"))
             for name in ("qwen2.5-0.5b", "llama-3.1-8b", "qwen2.5-7b")}
    assert cross == {"qwen2.5-0.5b": (400, 202), "llama-3.1-8b": (339, 170), "qwen2.5-7b": (344, 172)}
    for n in (1024, 8192):  # "只量化权重，预填充几乎不会变快": above the crossover fp8 weights save no time
        assert on_card(LLAMA, n, H100, "fp8").seconds == pytest.approx(on_card(LLAMA, n, H100).seconds)


def chunked(cfg, n, size, spec):
    return sum(L.prefill_chunk(cfg, start, min(start + size, n), n).floor(spec.bf16_flops, spec.bandwidth).seconds
               for start in range(0, n, size))


def test_exercise_3_small_chunks_cost_a_weight_read_each():
    whole = on_card(LLAMA, 8192, H100).seconds
    assert round(chunked(LLAMA, 8192, 64, H100) * 1e3, 1) == 634.3
    assert round(chunked(LLAMA, 8192, 64, H100) / whole, 2) == 4.76
    weight_read = L.weight_bytes(LLAMA) / H100.bandwidth  # "时间约等于“块数 × 读一遍权重”"
    assert 1 < chunked(LLAMA, 8192, 64, H100) / (8192 // 64 * weight_read) < 1.05
    for size in (512, 2048, 8192):  # above the crossover every chunk is compute-bound: nothing lost
        assert chunked(LLAMA, 8192, size, H100) == pytest.approx(whole)


def test_a_chunk_attends_to_the_prefix_and_reads_its_kv():
    whole = L.prefill(LLAMA, 100)
    head, tail = L.prefill_chunk(LLAMA, 0, 60, 100), L.prefill_chunk(LLAMA, 60, 100, 100)
    assert head.flops + tail.flops == whole.flops  # the output layer once, with the prompt's last chunk
    assert head.linear_flops + L.output_layer_flops(LLAMA) == L.prefill(LLAMA, 60).linear_flops
    assert (tail.kv_read_bytes, tail.kv_write_bytes) == (L.kv_bytes(LLAMA, 60), L.kv_bytes(LLAMA, 40))
    assert tail.bytes == L.weight_bytes(LLAMA) + L.kv_bytes(LLAMA, 100)
    assert L.prefill_chunk(LLAMA, 0, 100, 100) == whole
    for start, end in ((0, 0), (60, 50), (0, 101), (-1, 10)):
        with pytest.raises(ValueError, match="start"):
            L.prefill_chunk(LLAMA, start, end, 100)
