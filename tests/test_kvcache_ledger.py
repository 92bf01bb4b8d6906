"""Chapter KV cache (book/ch05-kvcache.md): what its page says of Llama-3.1-8B, recomputed by the
ledger (the seeds' KV figures, both ways of making the next token under max(F/P, M/W), GQA against
MHA, the 24 GiB card), and the bytes a cache really allocates."""
import pytest
import torch

from minillm.engine.config import load_config
from minillm.engine.contiguous_cache import ContiguousKVCache
from minillm.lab import estimate as L
from minillm.lab.gpus import lookup_gpu

GiB = 2**30

LLAMA, H100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")


def next_token(cfg, t, use_cache, spec):
    if use_cache:
        return L.decode_step(cfg, 1, t, spec.bandwidth).floor(spec.bf16_flops)
    return L.prefill(cfg, t).floor(spec.bf16_flops, spec.bandwidth)


def test_cached_steps_read_recomputed_steps_compute():
    for t in (1024, 4096, 8192):
        cached, again = next_token(LLAMA, t, True, H100), next_token(LLAMA, t, False, H100)
        assert (cached.bound, again.bound) == ("memory", "compute")
        assert 0.8 * t < again.flops / cached.flops < t  # "大约 t 倍的运算"
    cached, again = next_token(LLAMA, 8192, True, H100), next_token(LLAMA, 8192, False, H100)
    assert round(again.flops / cached.flops) == 6835
    assert (round(again.seconds / cached.seconds), round(8192 / H100.ridge_point)) == (26, 28)
    # "下界之比约是重算那一步的强度（约为 t）除以卡的脊点"
    assert again.seconds / cached.seconds == pytest.approx(again.intensity / H100.ridge_point, rel=0.02)
    assert 0.9 * 8192 < again.intensity < 8192
    batch = L.decode_step(LLAMA, 16, 8192, H100.bandwidth).floor(H100.bf16_flops)
    assert round(16 * again.seconds / batch.seconds) == 215
    assert batch.bytes - cached.bytes == 15 * L.kv_bytes(LLAMA, 8192)  # "比单个请求只多读其余 15 个请求的 KV"


def batch_gap(t, batch=16):
    """How many times longer ``batch`` recomputes take than one cached step of the batch, at ``t``."""
    again = next_token(LLAMA, t, False, H100)
    return batch * again.seconds / L.decode_step(LLAMA, batch, t, H100.bandwidth).floor(H100.bf16_flops).seconds


def test_a_batch_widens_the_gap():
    """"t 越长差得越多"; the summary's "这批的 KV 比权重小得多时，倍数接近再乘上批大小"."""
    gaps = [batch_gap(t) for t in (1024, 2048, 4096, 8192, 16384, 32768)]
    assert gaps == sorted(gaps)
    single = {t: next_token(LLAMA, t, False, H100).seconds / next_token(LLAMA, t, True, H100).seconds for t in (1024, 8192)}
    assert batch_gap(1024) / (16 * single[1024]) > 0.85  # 16 requests' KV at 1K: an eighth of the weights
    assert batch_gap(8192) / (16 * single[8192]) < 0.6  # at 8K as large as the weights: far from 16 times
    layers = L.matmul_flops_per_token(LLAMA) - L.output_layer_flops(LLAMA)
    assert 2 * layers / L.attention_flops_per_token(LLAMA, 1) == 53248  # attention catches up with the layers


def test_a_whole_generation():
    """Exercise 2 and the page: 1,024 tokens after a 1,024-token prompt, each step's floor summed."""
    def generation(use_cache):
        steps = [next_token(LLAMA, 1024, False, H100)]
        steps += [next_token(LLAMA, 1024 + k, use_cache, H100) for k in range(1, 1024)]
        return sum(f.flops for f in steps), sum(f.seconds for f in steps)

    (f_cached, s_cached), (f_again, s_again) = generation(True), generation(False)
    assert (round(f_cached / 1e12, 1), round(f_again / 1e15, 1), round(f_again / f_cached)) == (30.7, 22.6, 735)
    assert (round(s_cached, 2), round(s_again, 2)) == (4.98, 22.85)
    assert 2 < s_again / s_cached < 10  # "运算差几百倍，时间却只差几倍"
    for t in (1024, 2047):  # "在这样的上下文下带 cache 的一步只贵不到三成"
        one, sixteen = (L.decode_step(LLAMA, b, t, H100.bandwidth).floor(H100.bf16_flops).seconds for b in (1, 16))
        assert 1 < sixteen / one < 1.3


def test_the_seed_figures_of_the_kv():
    mha = LLAMA.replace(num_kv_heads=LLAMA.num_heads)
    assert L.kv_bytes_per_token(LLAMA) == 131072 and L.kv_bytes_per_token(mha) == 4 * 131072
    assert [L.kv_bytes(LLAMA, c) / GiB for c in (1024, 4096, 8192, 131072)] == [0.125, 0.5, 1, 16]
    budget = L.memory_budget(LLAMA, "24GiB", 0.92)
    assert round(budget.kv_budget_bytes / GiB, 2) == 7.12 and round(budget.token_capacity) == 58347
    assert L.kv_bytes(LLAMA, LLAMA.max_position_embeddings) > budget.kv_budget_bytes  # a full-length request does not fit
    assert L.kv_bytes_per_token(LLAMA) // 8 == 16384  # bytes per token over an int64 token id
    assert L.preallocation_waste(8192, 1024) == 0.875
    assert (budget.kv_budget_bytes // L.kv_bytes(LLAMA, 8192), budget.concurrent_requests(1024)) == (7, 56)
    assert round(budget.requests_at(1024), 1) == 57.0


def test_gqa_against_mha_on_a_24gib_card_and_on_the_h100():
    mha = LLAMA.replace(num_kv_heads=LLAMA.num_heads)
    same = L.memory_budget(LLAMA, "24GiB", 0.92, kv_config=mha)
    real = L.memory_budget(mha, "24GiB", 0.92)
    gqa = L.memory_budget(LLAMA, "24GiB", 0.92)
    assert round(same.token_capacity) == 14587 and same.token_capacity == gqa.token_capacity / 4  # a quarter
    assert round(real.token_capacity) == 11515 and real.kv_budget_bytes < same.kv_budget_bytes
    ratio = {b: L.decode_step(mha, b, 4096, H100.bandwidth).floor(H100.bf16_flops).seconds
             / L.decode_step(LLAMA, b, 4096, H100.bandwidth).floor(H100.bf16_flops).seconds for b in (1, 16)}
    assert (round(ratio[1], 2), round(ratio[16], 2)) == (1.19, 2.11)  # "只慢两成" and "慢了一倍多"


def test_exercises_1_and_3():
    qwen = load_config("qwen2.5-7b")
    assert (L.kv_bytes_per_token(qwen), L.kv_bytes(qwen, 32768) / GiB) == (56 * 1024, 1.75)
    assert L.kv_bytes_per_token(LLAMA) / L.kv_bytes_per_token(qwen) > 2  # "两倍多的上下文"
    fp8 = L.memory_budget(LLAMA, "24GiB", 0.92, kv_dtype="fp8")
    assert (round(fp8.token_capacity), round(fp8.requests_at(8192), 1)) == (116695, 14.2)


def test_a_cache_allocates_what_the_ledger_counts():
    smol = load_config("smollm2-135m")
    for cfg, dtype, device, name in ((LLAMA, torch.bfloat16, "meta", "bf16"), (smol, torch.float32, "cpu", "fp32")):
        cache = ContiguousKVCache(cfg, 1, 64, dtype, device)
        assert cache.kv.nbytes // 64 == L.kv_bytes_per_token(cfg, name)


def test_the_measured_ratio_is_the_floor_ratio_moved_by_each_step_s_share():
    """"实测之比正好等于下界之比乘以带 cache 那一步的“下界 ÷ 实测”、再除以重算那一步的"."""
    from minillm.lab.floors import Timed

    cached = Timed(0.012, next_token(LLAMA, 4096, True, H100))
    again = Timed(0.1, next_token(LLAMA, 4096, False, H100))
    floor_ratio = again.floor.seconds / cached.floor.seconds
    assert again.seconds / cached.seconds == pytest.approx(floor_ratio * cached.share / again.share)
