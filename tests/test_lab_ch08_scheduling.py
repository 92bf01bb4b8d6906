"""The scheduling lab's kit (minillm.lab.chapters.ch08_scheduling): the contract's steps at a
device's ceilings, the slot-step estimate, the schedule's floor, and what a run reports."""
import math

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402

from minillm import LLM, load_model  # noqa: E402
from minillm.engine.config import load_config  # noqa: E402
from minillm.lab import estimate as L  # noqa: E402
from minillm.lab.chapters import ch08_scheduling as ch08  # noqa: E402
from minillm.lab.gpus import lookup_gpu  # noqa: E402
from minillm.lab.notebook import greedy  # noqa: E402

CFG = load_config("llama-3.1-8b")


def test_a_prompt_in_spans_costs_what_it_costs_whole():
    n = 8192
    assert ch08.prefill_span_flops(CFG, 0, n, n) == L.prefill(CFG, n).flops
    spans = [(0, 2041), (2041, 4082), (4082, 6123), (6123, 8164), (8164, 8192)]
    assert sum(ch08.prefill_span_flops(CFG, a, b, n) for a, b in spans) == L.prefill(CFG, n).flops
    # the output layer is billed once, with the span that ends the prompt
    assert ch08.prefill_span_flops(CFG, 0, 100, n) == 100 * (L.matmul_flops_per_token(CFG) - L.output_layer_flops(CFG)) \
        + L.prefill_attention_flops(CFG, 100)


def test_the_contract_on_an_h100():
    steps = ch08.contract_on_gpu()
    gpu = lookup_gpu("H100 SXM")
    assert (steps.prompt_len, steps.budget, steps.running, steps.ctx) == (8192, 2048, 7, 1024)
    assert steps.chunk_tokens == 2041 and steps.chunk_count == math.ceil(8192 / 2041) == 5
    assert steps.spans[0] == (0, 2041) and steps.spans[-1] == (8164, 8192)
    decode = L.decode_step(CFG, 7, 1024, gpu.bandwidth)
    assert steps.decode.flops == decode.flops and steps.decode.bytes == decode.bytes
    assert steps.decode.bound == "memory" and steps.whole.bound == "compute"
    assert steps.whole.flops == decode.flops + L.prefill(CFG, 8192).flops
    assert steps.whole.seconds == pytest.approx((decode.flops + L.prefill(CFG, 8192).flops) / gpu.bf16_flops)
    # chunks: each shorter than the whole, later ones heavier (more attention), the tiny last one light
    secs = [f.seconds for f in steps.chunks]
    assert secs[0] < secs[1] < secs[2] < secs[3] and secs[4] < secs[0]
    assert steps.worst_chunk is steps.chunks[3]
    assert steps.chunked_seconds > steps.whole.seconds  # chunking saves no compute
    words = ch08.contract_words(steps)
    assert all(key.startswith("contract_gpu_") for key in words)
    assert words["contract_gpu_chunks"] == "5" and words["contract_gpu_chunk_tokens"] == "2,041"
    assert words["contract_gpu_whole_bound"] == "算力"


def test_a_larger_budget_means_fewer_longer_chunks():
    small, big = ch08.contract_on_gpu(budget=1024), ch08.contract_on_gpu(budget=8192)
    assert small.chunk_count == 9 and big.chunk_count == 2
    assert small.worst_chunk.seconds < big.worst_chunk.seconds
    with pytest.raises(ValueError):
        ch08.contract_steps(CFG, 100, 4, 4, 16, 1e12, 1e9)


def test_slot_estimate_by_hand():
    est = ch08.slot_estimate([4, 1, 1, 1], slots=2)
    assert est["static"]["steps"] == 5 and est["static"]["idle"] == pytest.approx(1 - 7 / 10)
    assert est["static"]["starts"] == [0, 0, 4, 4]
    assert est["continuous"]["steps"] == 4 and est["continuous"]["starts"] == [0, 0, 1, 2]
    assert est["continuous"]["idle_steps"] == 1 and est["lower_bound"] == 4


def test_schedule_floor_counts_each_step():
    cfg, P, W = load_config("tiny"), 1e11, 1e10
    steps = [{"num_prefill_tokens": 10, "num_decode_tokens": 0, "num_sampled": 1},
             {"num_prefill_tokens": 0, "num_decode_tokens": 2, "num_sampled": 2}]
    body = L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg)
    one = L.roofline_floor(10 * (body + L.attention_flops_per_token(cfg, 8)) + L.output_layer_flops(cfg),
                           L.weight_bytes(cfg, "fp32") + L.kv_bytes(cfg, 10, "fp32"), P, W).seconds
    two = L.roofline_floor(2 * (body + L.attention_flops_per_token(cfg, 8)) + 2 * L.output_layer_flops(cfg),
                           L.weight_bytes(cfg, "fp32") + L.kv_bytes(cfg, 16, "fp32"), P, W).seconds
    assert ch08.schedule_floor(cfg, steps, 8, P, W, "fp32") == pytest.approx(one + two)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny", device="cpu", dtype=torch.float32, weights="random")


def test_run_summary_of_a_static_run(tiny):
    prompts = [[1 + i] * 20 for i in range(4)]
    lens = [3, 1, 1, 1]
    llm = LLM(tiny, num_kv_blocks=ch08.pool_blocks([20] * 4, lens), max_num_seqs=2, scheduling="static",
              enable_prefix_caching=False)
    run = ch08.run_summary(llm, llm.generate(prompts, [greedy(o) for o in lens], use_tqdm=False), slots=2)
    est = ch08.slot_estimate(lens, 2)
    assert len(run["steps"]) == est["static"]["steps"] and run["idle"] == pytest.approx(est["static"]["idle"])
    assert [len(t) for t in run["tokens"]] == lens and run["blocks_back"] and run["preemptions"] == 0
    assert run["prefill_tokens"] == 80


def test_serve_contract_sees_the_stall(tiny):
    prompts, lens, contract = [[5] * 8, [6] * 8], [20, 20], list(range(1, 129))
    chunked = ch08.serve_contract(tiny, prompts, lens, contract, budget=34, join_after=3)
    assert sum(chunked["chunks"]) == 128 and all(n <= 32 for n in chunked["chunks"])
    assert len(chunked["chunks"]) == 4
    assert chunked["worst_gap"] >= chunked["decode_step"] > 0 and chunked["contract_ttft"] > 0
    whole = ch08.serve_contract(tiny, prompts, lens, contract, budget=None, join_after=3)
    assert whole["chunks"] == [128]
    assert all(whole["outputs"][rid].token_ids == chunked["outputs"][rid].token_ids for rid in whole["outputs"])
    assert len(whole["outputs"]["contract"].token_ids) == ch08.CONTRACT_ANSWER


def test_tpot_words_stand_alone():
    longer = ch08.tpot_words(0.010, 0.012)
    assert longer.startswith("连续批处理的出字间隔（TPOT p50）比静态批处理长（12.0 ms 对 10.0 ms）")
    same = ch08.tpot_words(0.012, 0.012)
    assert same.startswith("连续批处理的出字间隔（TPOT p50）这一次没有变长") and "却" not in same


def test_goodput_words_name_the_bound():
    below = ch08.goodput_words({"goodput": 0.8, "rate": 1.0}, 1.01)
    assert below.endswith("没有超过离线吞吐（1.01 请求/s）这个上限。")
    above = ch08.goodput_words({"goodput": 1.2, "rate": 2.0}, 1.01)
    assert "比离线吞吐（1.01 请求/s）这个“上限”还高" in above


def test_press_words_choose_each_part_on_its_own():
    memory = L.roofline_floor(1e9, 1e9, 1e11, 1e9)  # 10 ms of compute, 1 s of bytes
    compute = L.roofline_floor(1e11, 1e6, 1e11, 1e9)
    mib = 512 * 2**20
    # the batch part outweighs the recompute, the copy outweighs the swap run's rest
    words = ch08.press_words({"重算": 0.4, "换出": 0.3}, 0.1, 0.2, 4, memory, mib)
    assert "重算本身只占 100.0 ms，其余 300.0 ms 来自池子小了" in words
    assert "至少一半是拷贝本身（200.0 ms），批变小只占 100.0 ms" in words
    assert "最多同时跑 4 个请求，解码一步的下界受带宽限制：每一步都要把 512 MiB" in words
    # the other way round, and a compute-bound decode step
    words = ch08.press_words({"重算": 0.3, "换出": 0.3}, 0.2, 0.1, 4, compute, mib)
    assert "至少一半是重算本身（200.0 ms），池子小了、同时跑的请求少了、步数多了只占 100.0 ms" in words
    assert "拷贝只占 100.0 ms，其余 200.0 ms 也来自批变小" in words
    assert "解码一步的下界仍受算力限制（每步的权重只有 512 MiB）" in words and "受带宽限制：" not in words
