"""The kit of chapter 4 (解码): the page's ledger of Llama-3.1-8B on the spec cards (every floor
max(F/P, M/W) with its ceiling), the lab's sweep arithmetic and the top-k-first sampler."""
import pytest
import torch

from minillm.engine.config import load_config
from minillm.engine.loader import load_model
from minillm.engine.sampling import SamplingParams, make_generator, sample
from minillm.lab import estimate as L
from minillm.lab.chapters import ch04_decode as kit
from minillm.lab.gpus import lookup_gpu


@pytest.fixture(scope="module")
def numbers():
    return kit.page_numbers()


def test_the_question_a_petaflop_card_and_milliseconds_per_token(numbers):
    assert numbers["step_floor"] == "≥ 4.83 ms（带宽：M/W）"
    assert (numbers["step_gb"], numbers["step_gflop"], numbers["step_compute"]) == ("16.19 GB", "15.5", "15.7 µs")
    assert numbers["step_ratio"] == "308" and numbers["l4_floor"] == "≥ 53.98 ms（带宽：M/W）"


def test_the_seed_figures_of_the_1_tb_s_card(numbers):
    assert [numbers[f"tb_gb_{b}"] for b in (1, 16, 48)] == ["16.19 GB", "18.21 GB", "22.50 GB"]
    assert [numbers[f"tb_tok_{b}"] for b in (1, 16, 48)] == ["62", "879", "2,133"]
    assert numbers["tb_floor_16"] == "≥ 18.21 ms（带宽：M/W）" and numbers["kv_intensity"] == "4"


def test_decode_stays_bandwidth_bound_on_the_h100(numbers):
    cfg, h100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")
    assert (numbers["int_limit_1024"], numbers["int_limit_8192"], numbers["c_cross"]) == ("116", "18", "393")
    c = kit.always_bandwidth_bound_from(cfg, h100.ridge_point)
    assert kit.intensity_limit(cfg, int(c) + 1) < h100.ridge_point < kit.intensity_limit(cfg, int(c) - 1)
    assert kit.card_step(cfg, 4096, 1024, h100).bound == "memory"


def test_the_cards_at_their_largest_batch(numbers):
    assert (numbers["b24"], numbers["b80"], numbers["conc24"]) == ("56", "469", "57.0")
    assert (numbers["rtx_floor_max"], numbers["rtx_growth"], numbers["rtx_agg_max"]) == ("≥ 23.39 ms（带宽：M/W）", "1.46", "2,394")
    rows = {r[0]: r for r in kit.card_rows()}
    assert rows["H100 SXM"][3] == numbers["step_floor"] and rows["RTX 4090"][5] == 56
    assert all(r[3].endswith("（带宽：M/W）") and r[6].endswith("（带宽：M/W）") for r in rows.values())


def test_exercises(numbers):
    assert (numbers["ex1_b_bw"], numbers["ex1_b_mem"]) == ("157", "117")
    assert numbers["ex1_wall"].startswith("先撞上的是容量墙")
    assert (numbers["ex2_ratio"], numbers["ex2_int_mha"]) == ("2.6", "1")
    assert (numbers["ex3_speedup_1"], numbers["ex3_speedup_64"]) == ("1.94", "1.19")


def test_toy_sampling_keeps_the_top_p_prefix():
    table, words = kit.toy_sampling_rows(2000)
    assert words["top_p_kept"] == "3" and float(words["top_p_mass_before"]) < 0.8 <= float(words["top_p_mass"])
    greedy = [row[3] for row in table[1:]]
    assert greedy == ["1.000"] + ["0.000"] * 5


def test_sweep_arithmetic():
    cfg = load_config("smollm2-135m")
    s = kit.DecodeSweep(cfg, "float32", 9e10, 3.6e10, step={(1, 128): 0.05, (32, 128): 0.3}, linear={2: 0.04, 32: 0.25})
    assert s.floor(1, 128).bound == "memory" and s.floor(32, 128).bound == "compute"
    assert s.mbu(1, 128) == pytest.approx(L.decode_step(cfg, 1, 128, 3.6e10, "fp32").bytes / 0.05 / 3.6e10)
    assert s.linear_rate(32) == pytest.approx(32 * L.matmul_flops_per_token(cfg) / 0.25)
    assert s.linear_read(2) == pytest.approx(L.matmul_param_count(cfg) * 4 / 0.04)
    assert s.points(128) == [1, 32] and kit.context_batch((1, 2, 4, 8, 16, 32)) == 4


def test_a_step_under_its_floor_is_explained_by_its_linear_layers_or_fails():
    cfg = load_config("smollm2-135m")
    P, W = 9e10, 3.6e10
    fast_read = L.matmul_param_count(cfg) * 4 / (2 * W)  # the weights read at twice the probed copy
    floor = L.decode_step(cfg, 1, 128, W, "fp32").floor(P)
    s = kit.DecodeSweep(cfg, "float32", P, W, step={(1, 128): 0.5 * floor.seconds}, linear={1: fast_read})
    assert s.why(1, 128) == ("B = 1、c = 128 时，线性层读权重的速度 72.0 GB/s，高于拷贝探测的 36.0 GB/s"
                             "（拷贝要读也要写，这里只读）")
    s.linear[1] = 4 * fast_read  # now at half the copy: nothing explains the step
    assert s.why(1, 128) is None
    s.step[1, 128] = floor.seconds
    assert s.why(1, 128) is None


def test_decode_sweep_times_a_real_model():
    torch.set_num_threads(1)
    model = load_model("tiny", device="cpu", dtype=torch.float32, weights="random")
    s = kit.decode_sweep(model, (1, 2), 16, (16, 32), 1e11, 4e10, steps=1, rounds=1)
    assert sorted(s.step) == [(1, 16), (1, 32), (2, 16)] and sorted(s.linear) == [1, 2]
    assert all(t > 0 for t in (*s.step.values(), *s.linear.values()))


def test_top_k_first_draws_the_same_tokens():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=i) for i in range(6)]
    gens = lambda: [make_generator(i, "cpu") for i in range(6)]
    assert torch.equal(sample(logits, params, gens()), kit.sample_topk_first(logits, params, gens()))
    timed = kit.time_samplers("cpu", 4, 1000, repeats=1)
    assert timed["same"] and min(timed[k] for k in ("greedy", "sort", "topk")) > 0


def test_host_share_is_the_engine_time_over_the_serial_step():
    host = {"batch": 256, "ctx": 1000, "engine_median_s": 0.003, "launches": {"per_step": 1234, "model": "llama-3.1-8b"}}
    words = kit.host_words(host)
    floor = kit.card_step(load_config("llama-3.1-8b"), 256, 1000, lookup_gpu(kit.CARD))
    assert floor.bound == "memory" and words["host_engine"] == "3.00 ms" and words["host_ops"] == "1,234"
    assert words["host_share"] == f"{0.003 / (0.003 + floor.seconds):.0%}"


def test_sides_name_each_side_the_sweep_reaches():
    both = kit.sides_words("2.6", "float32", "128", [1, 2, 4, 8], [1, 2], [4, 8])
    assert both.endswith("上下文 128 时 B = 1、2 的一步落在带宽一侧，B = 4、8 已经落到算力一侧。")
    assert kit.sides_words("0.5", "float32", "128", [1, 2], [], [1, 2]).endswith("每个 B（1、2）都落在算力一侧，连 B = 1 也不例外。")
    assert kit.sides_words("300", "bfloat16", "1,024", [1, 8], [1, 8], []) == "上下文 1,024 时扫到的每个 B（1、8）都落在带宽一侧。"


def test_growth_past_the_ridge_in_three_bands():
    assert kit.growth_verdict(6.0, 3.0).startswith("实测涨得比下界慢")
    assert kit.growth_verdict(6.0, 5.5).startswith("实测涨得和下界差不多") and kit.growth_verdict(6.0, 6.5).startswith("实测涨得和下界差不多")
    assert kit.growth_verdict(6.0, 7.0) == "实测涨得比下界快：批大了，实测离下界反而更远。"


def test_read_words_pick_the_side_of_the_copy_probe():
    args = (4, "513 MiB", "51.26 ms")
    assert kit.read_words(*args, 1e10, 4e10, False, "1 个 CPU 线程").endswith("是拷贝探测的 25%：几行的矩阵乘边读边算，1 个 CPU 线程喂不满内存总线。")
    assert kit.read_words(*args, 1e10, 4e10, True, "GPU").endswith("矩阵-向量乘的 kernel 跑不满显存带宽。")
    fast = kit.read_words(*args, 5e10, 4e10, True, "GPU")
    assert fast == "B = 4 时线性层单独跑，读 513 MiB 的权重用了 51.26 ms，读速度 50.0 GB/s，不比拷贝探测慢（125%）：只读不写，探测的拷贝带宽不是它的上限。"


def test_gap_words_state_both_linear_sides():
    assert kit.gap_words(1e10, 4e10, 6e10, 1e11, True) == "这台机器上，带宽一侧的线性层读权重比拷贝慢。算力一侧的窄矩阵只跑到方阵探测的 60%。"
    assert kit.gap_words(5e10, 4e10, 2e11, 1e11, True) == "这台机器上，带宽一侧的线性层读权重不比拷贝慢。算力一侧的窄矩阵也跑到了方阵探测的速率。"
    assert kit.gap_words(1e10, 4e10, 6e10, 1e11, False).endswith("扫到的批都没有越过脊点，窄矩阵的速率不在差距里。")


def test_topk_words_time_both_samplers():
    assert kit.topk_words(0.116, 0.005) == "先取 top-k 只要 5.00 ms，快了 23.2 倍。"
    assert kit.topk_words(0.010, 0.015) == "先取 top-k 要 15.00 ms，反而比整表排序慢，是它的 1.5 倍。"
