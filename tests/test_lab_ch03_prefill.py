"""The kit of chapter 3 (预填充): the page's ledger of Llama-3.1-8B on the spec cards, the chunked
prefill floors, and the lab's sweep arithmetic (the output layer billed once, the linear layers'
bytes without the input embedding)."""
import pytest
import torch

from minillm.engine.config import load_config
from minillm.engine.loader import load_model
from minillm.lab import estimate as L
from minillm.lab.chapters import ch03_prefill as kit
from minillm.lab.gpus import lookup_gpu


@pytest.fixture(scope="module")
def numbers():
    return kit.page_numbers()


def test_the_question_short_is_bandwidth_bound_long_is_compute_bound(numbers):
    assert numbers["short_floor"] == "≥ 4.79 ms（带宽：M/W）"
    assert numbers["long_floor"] == "≥ 133.34 ms（算力：F/P）"
    assert numbers["q_ratio"] == "28"
    assert (numbers["n1_read"], numbers["n1_compute"]) == ("4.79 ms", "15 µs")


def test_the_engine_bills_the_output_layer_once(numbers):
    assert (numbers["rule_int_512"], numbers["rule_int_2048"]) == ("478", "1,914")  # the rule of thumb
    assert (numbers["int_512"], numbers["int_2048"]) == ("447", "1,818")  # as the engine computes
    assert (numbers["layer_gflop"], numbers["lm_head_gflop"], numbers["matmul_gflop"]) == ("13.96", "1.05", "15.01")
    cfg = load_config("llama-3.1-8b")
    assert kit.linear_flops(cfg, 100) == L.prefill(cfg, 100).linear_flops


def test_crossover_on_the_h100_and_the_cards(numbers):
    assert numbers["cross"] == "339" and numbers["card_ridge"] == "295"
    assert numbers["cross_low"] == "88（RTX 3090）" and numbers["cross_high"] == "480（L40S）"
    cfg, h100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")
    assert kit.card_floor(cfg, 339, h100).bound == "compute" and kit.card_floor(cfg, 338, h100).bound == "memory"
    assert all(row[3].endswith("（算力：F/P）") for row in kit.card_rows())


def test_attention_share_grows_with_the_prompt(numbers):
    assert [numbers[f"attn_share_{n}"] for n in (8192, 32768, 131072)] == ["13%", "38%", "71%"]


def test_exercises(numbers):
    assert numbers["ex1_ratio"] == numbers["ex1_flops_ratio"] == "6.0"
    assert (numbers["ex2_llama-3.1-8b"], numbers["ex2_llama-3.1-8b_fp8"]) == ("339", "170")
    assert numbers["ex3_64"].startswith("634.3 ms（4.76 倍")
    assert numbers["ex3_8192"] == "133.3 ms（1.00 倍，1 块）"


def test_one_chunk_is_the_whole_prefill():
    cfg, h100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")
    for n in (1, 100, 8192):
        assert kit.chunked_floor(cfg, n, n, h100) == pytest.approx(kit.card_floor(cfg, n, h100).seconds)
    with pytest.raises(ValueError):
        kit.chunked_floor(cfg, 8192, 0, h100)


def test_linear_bytes_leave_out_the_input_embedding():
    llama, smol = load_config("llama-3.1-8b"), load_config("smollm2-135m")
    assert kit.linear_bytes(llama, "bf16") == L.weight_bytes(llama) - 2 * (llama.vocab_size * llama.hidden_size
                                                                           + L.param_breakdown(llama)["norms"])
    # tied: the output layer reads the table, so every weight but the norms is read
    assert smol.tie_word_embeddings
    assert kit.linear_bytes(smol, "fp32") == L.weight_bytes(smol, "fp32") - 4 * L.param_breakdown(smol)["norms"]


def test_sweep_arithmetic():
    cfg = load_config("smollm2-135m")
    s = kit.Sweep(cfg, "float32", 1e11, 4e10, forward={1: 0.05, 256: 0.8}, linear={1: 0.04, 256: 0.7})
    assert s.knee == pytest.approx(0.05 / (0.8 / 256))
    assert s.mfu(256) == pytest.approx(L.prefill(cfg, 256, "fp32").flops / 0.8 / 1e11)
    assert s.read_rate(1) == pytest.approx(kit.linear_bytes(cfg, "fp32") / 0.04)
    assert s.floor(1).bound == "memory" and s.floor(256).bound == "compute"
    assert s.crossover == L.prefill_crossover(cfg, 1e11, 4e10, "fp32")
    assert kit._beat_why(s, 1) is None and kit._beat_why(s, 256) is None  # both above their floors
    fast = kit.Sweep(cfg, "float32", 1e11, 4e10, forward={256: 0.01}, linear={256: 0.005})
    assert kit._beat_why(fast, 256) == (f"n = 256 时，模型自己的线性层跑出 {fast.shape_rate(256) / 1e9:,.1f} GFLOP/s，"
                                        "高于方阵探测的 100.0 GFLOP/s")


def test_sweep_times_a_real_model():
    torch.set_num_threads(1)
    model = load_model("tiny", device="cpu", dtype=torch.float32, weights="random")
    s = kit.sweep(model, (1, 8), 1e11, 4e10, repeats=2, rounds=2)
    assert s.lengths == [1, 8] and s.repeats == 2
    assert all(t > 0 for t in (*s.forward.values(), *s.linear.values()))
    with pytest.raises(ValueError, match="rounds"):
        kit.sweep(model, (1,), 1e11, 4e10, repeats=1, rounds=2)
    seconds = kit.logits_seconds(model, 8, repeats=1)
    assert set(seconds) == {False, True} and min(seconds.values()) > 0


def test_shape_words_choose_on_the_rate_and_the_linear_share_of_the_gap():
    faster = kit.shape_words(256, 2e11, 1e11, 0.0, 0.3)
    assert "比方阵探测还快（200%）" in faster and "到别处去找" in faster
    main = kit.shape_words(256, 5e10, 1e11, 0.2, 0.3)
    assert "是方阵探测的 50%" in main and "不少于整次预填充比下界多出的 300.0 ms 的一半" in main
    assert main.endswith("算力一侧的差距主要在这里。")
    minor = kit.shape_words(256, 5e10, 1e11, 0.1, 0.3)
    assert "不到整次预填充比下界多出的 300.0 ms 的一半" in minor and minor.endswith("大半在线性层之外。")


def test_knee_words_compare_the_floor_share_at_both_ends():
    short_far = kit.knee_words(0.28, 0.66)
    assert short_far.startswith("最短的 prompt 离下界比最长的远（下界占实测的 28%，最长的占 66%）")
    long_far = kit.knee_words(0.7, 0.5)
    assert long_far.startswith("最长的 prompt 离下界不比最短的近（下界占实测的 50%，最短的占 70%）")


def test_read_words_name_the_device_and_the_cache_only_when_known():
    cpu = kit.read_words(1, 512 * 2**20, 0.05, 4e10, False, None)
    assert "读速度 10.7 GB/s，是拷贝探测的 27%" in cpu and "一个线程" in cpu
    gpu = kit.read_words(1, 512 * 2**20, 0.05, 4e10, True, None)
    assert "是拷贝探测的 27%" in gpu and "显存带宽" in gpu and "线程" not in gpu
    cached = kit.read_words(1, 512 * 2**20, 0.01, 4e10, False, 32 * 2**20)
    assert "比拷贝探测还快（134%）" in cached and "留在 32 MiB 的缓存里" in cached
    unknown = kit.read_words(1, 512 * 2**20, 0.01, 4e10, False, None)
    assert unknown.endswith("一部分权重还留在缓存里。") and " B " not in unknown


def test_gap_summary_names_only_the_measured_shortfalls():
    both = kit.gap_summary(True, True)
    assert "跑不到方阵的速率" in both and "读权重比拷贝慢" in both
    assert "读权重倒比拷贝快" in kit.gap_summary(True, False)
    assert "矩阵乘倒比方阵跑得快" in kit.gap_summary(False, True)
    neither = kit.gap_summary(False, False)
    assert "读权重也比拷贝快" in neither and "慢" not in neither


def test_every_row_logits_floor_and_words():
    cfg = load_config("smollm2-135m")
    f = kit.every_row_floor(cfg, 256, 1e11, 4e10)
    assert f.flops == L.output_layer_flops(cfg) * 255 and f.bytes == 255 * cfg.vocab_size * 4
    assert f.seconds == max(f.flops / 1e11, f.bytes / 4e10)
    assert "反而快 10.0 ms" in kit.every_row_words(-0.01, f)
    assert "站得住" in kit.every_row_words(f.seconds * 2, f)
    slow_math, slow_write = kit.every_row_floor(cfg, 256, 1e11, 4e15), kit.every_row_floor(cfg, 256, 1e15, 4e10)
    assert (slow_math.bound, slow_write.bound) == ("compute", "memory")
    assert "还少" in kit.every_row_words(slow_math.seconds / 2, slow_math)
    assert "矩阵乘跑得比探测的方阵快" in kit.every_row_words(slow_math.seconds / 2, slow_math)
    assert "这里只写" in kit.every_row_words(slow_write.seconds / 2, slow_write)


def test_last_row_seconds_prefer_the_sweep():
    s = kit.Sweep(load_config("smollm2-135m"), "float32", 1e11, 4e10, forward={1: 0.05, 256: 0.8})
    assert kit.last_row_seconds(s, 256, {False: 0.9, True: 1.2}) == 0.8
    assert kit.last_row_seconds(s, 128, {False: 0.4, True: 0.6}) == 0.4
