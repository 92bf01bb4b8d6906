"""Chapter 分页的 KV cache: the ledger's prefix reuse against the engine's own hits, and the values
behind what the page says of a 24 GiB card, of shared system prompts and of decode attention."""
import pytest
import torch

from minillm import LLM, SamplingParams, load_model
from minillm.engine.config import load_config
from minillm.engine.kernels import triton_attention as kernel
from minillm.engine.paging import KVCacheManager
from minillm.lab import estimate as L
from minillm.lab.gpus import lookup_gpu
from minillm.lab.workload import random_prompts, uniform_lengths

CFG = load_config("llama-3.1-8b")
CARD = L.memory_budget(CFG, "24GiB", 0.92)


def test_prefix_hits_are_whole_blocks_and_leave_the_last_token():
    assert L.common_prefix(list(range(40)) + [99], list(range(40))) == 40
    assert L.common_prefix([1, 2, 3], [1, 5]) == 1 and L.common_prefix([], [1]) == 0
    assert L.prefix_hit_tokens(41, 40, 16) == 32
    assert L.prefix_hit_tokens(32, 32, 16) == 16  # the prompt's last token is always computed
    assert L.prefix_hit_tokens(32, 32, 1) == 31 and L.prefix_hit_tokens(10, 0, 16) == 0


def test_the_engine_hits_what_the_ledger_says():
    """A conversation in token ids: each turn's prompt is the last one, its answer and new tokens;
    the engine's num_cached_tokens and the run's prefix_hit_tokens equal the ledger, turn by turn."""
    torch.manual_seed(0)
    model = load_model("tiny", device="cpu", dtype=torch.float32, weights="random")
    llm = LLM(model, block_size=16, num_kv_blocks=64)
    prompt, computed, hits = random_prompts([37], model.config.vocab_size, seed=1)[0], [], []
    for k in range(4):
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5 + 3 * k, ignore_eos=True),
                           use_tqdm=False)[0]
        common = max((L.common_prefix(prompt, c) for c in computed), default=0)
        assert out.num_cached_tokens == llm.stats()["prefix_hit_tokens"] == L.prefix_hit_tokens(len(prompt), common, 16)
        hits.append(out.num_cached_tokens)
        computed.append(prompt + out.token_ids[:-1])
        prompt = prompt + out.token_ids + random_prompts([11], model.config.vocab_size, seed=10 + k)[0]
    assert hits[0] == 0 and hits[-1] > hits[1] > 0


def test_reserving_the_longest_on_a_24gib_card():
    """The page's opening: 8,192 reserved for 1,024 used wastes 87.5%; the card holds 7 requests
    reserved at 8,192, 56 holding only what they use; blocks of 16 waste under 113 MiB in all."""
    assert L.preallocation_waste(8192, 1024) == 0.875
    assert L.kv_bytes(CFG, 8192 - 1024) / L.GiB == 0.875
    assert (CARD.concurrent_requests(8192), CARD.concurrent_requests(1024)) == (7, 56)
    assert 1024 / (1024 + 7.5) > 0.99
    assert 56 * L.kv_bytes(CFG, 16) / L.MiB == 112 < L.kv_bytes(CFG, 8192 - 1024) / L.MiB
    assert (8192 // 16, 8192 // 16 * 4) == (512, 2048)  # block table entries and int32 bytes


def test_the_block_table_figure():
    """The page's first figure: A, B, C grow together, a block each as they fill one; B's blocks go
    back to the tail of the free queue, so D takes the never-used block at the head, then B's two."""
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    lengths = {"A": 14, "B": 7, "C": 10}
    for step in range(4):
        for rid, n in lengths.items():
            if step * 4 < n:
                kv.allocate(rid, min(n, (step + 1) * 4))
    assert [kv.block_table(r) for r in "ABC"] == [[0, 3, 6, 8], [1, 4], [2, 5, 7]]
    kv.free("B")
    kv.allocate("D", 9)
    assert kv.block_table("D") == [9, 4, 1]  # the unused block 9, then B's, freed tail first


def test_utilization_at_blocks_of_16():
    """The estimate's figure: at blocks of 16 the half-empty last block leaves mean lengths of 128,
    1,024 and 8,192 above 94% (1,024: above 99%, as the page says of vLLM's default)."""
    utilization = {n: n / (n + (16 - 1) / 2) for n in (128, 1024, 8192)}
    assert min(utilization.values()) > 0.94 and utilization[1024] > 0.99


def test_shared_system_prompts_on_the_card():
    """32 requests sharing 2,010 tokens save 3,875 blocks of 16, more KV than the card has left;
    alone they do not fit the card's pool, sharing they do (exercise 2)."""
    saved = 31 * (2010 // 16)
    assert (2010 // 16, 2010 % 16, saved) == (125, 10, 3875)
    assert saved * L.kv_bytes(CFG, 16) > CARD.kv_budget_bytes
    pool = CARD.kv_budget_bytes // L.kv_bytes(CFG, 16)
    alone = sum(L.ceil_div(2010 + q, 16) for q in uniform_lengths(32, 16, 128, seed=11))
    assert alone > pool > alone - saved
    assert alone - saved < pool / 10  # sharing, the 32 take under a tenth of the pool


def test_waste_by_block_size_stays_under_one_reservation():
    """Exercise 1: 56 requests wasting half a block each, even of 256 tokens, waste less than one
    request reserved at 8,192 that uses 1,024."""
    waste_256 = 56 * (256 - 1) / 2 * L.kv_bytes_per_token(CFG)
    assert waste_256 < L.kv_bytes(CFG, 8192 - 1024)


def test_decode_attention_is_bandwidth_bound_and_outgrows_the_weights():
    """The kernel section: decode attention reads at n_h / n_kv = 4 FLOP/byte, under every card's
    ridge; a tl.dot of 16 rows holds a group of 4 query heads (25% real). Exercise 3: at B = 16,
    context 16,384, an H100 step reads more than twice the weights in KV, and takes longer for it."""
    assert CFG.num_heads // CFG.num_kv_heads / kernel.MIN_DOT_ROWS == 0.25
    h100, h200 = lookup_gpu("H100 SXM"), lookup_gpu("H200")
    for batch, ctx in ((1, 4096), (16, 4096), (16, 16384)):
        layer = L.roofline_floor(batch * L.attention_flops_per_token(CFG, ctx) / CFG.num_layers,
                                 L.kv_bytes(CFG, batch * ctx) / CFG.num_layers, h200.bf16_flops, h200.bandwidth)
        assert layer.intensity == pytest.approx(4) and layer.bound == "memory"
    attention = L.roofline_floor(16 * L.attention_flops_per_token(CFG, 16384), L.kv_bytes(CFG, 16 * 16384),
                                 h100.bf16_flops, h100.bandwidth)
    weights = L.roofline_floor(16 * L.matmul_flops_per_token(CFG), L.weight_bytes(CFG), h100.bf16_flops, h100.bandwidth)
    assert attention.bytes > 2 * weights.bytes and attention.seconds > 2 * weights.seconds  # most of the step
