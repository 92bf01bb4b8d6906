"""Chapter 调度: the ledger's slot schedule and chunked prefill, and the values behind what the page
says of the twenty colleagues, the contract on an H100, recompute against swap, and the exercises."""
import math

import pytest

from minillm.engine.config import load_config
from minillm.engine.engine_config import SWAP_SPACE_BYTES, EngineConfig
from minillm.engine.planner import plan
from minillm.lab import estimate as L
from minillm.lab.gpus import lookup_gpu
from minillm.lab.workload import contract_workload, lognormal_lengths

CFG = load_config("llama-3.1-8b")
H100 = lookup_gpu("H100 SXM")
INPUTS = contract_workload(CFG.vocab_size, 20, 8192).input_lens
OUTPUTS = lognormal_lengths(20, median=128, sigma=0.8, low=8, high=1024, seed=5)


def steps_and_idle(outputs, slots, static):
    spans = L.slot_schedule(outputs, slots, static=static)
    steps = max(end for _, end in spans)
    return steps, 1 - sum(outputs) / (slots * steps)


def test_slot_schedule_by_hand():
    assert L.slot_schedule([4, 1, 1, 1], 2, static=True) == [(0, 4), (0, 1), (4, 5), (4, 5)]
    assert L.slot_schedule([4, 1, 1, 1], 2) == [(0, 4), (0, 1), (1, 2), (2, 3)]
    assert steps_and_idle([4, 1, 1, 1], 2, True) == (5, pytest.approx(1 - 7 / 10))


def test_the_engine_runs_the_static_schedule_the_ledger_draws():
    """Static batching in the engine takes exactly the slot schedule's steps when the budget holds
    a batch's prompts (chapter 调度's first experiment, on the tiny model)."""
    import torch

    from minillm import LLM, SamplingParams, load_model

    torch.manual_seed(0)
    model = load_model("tiny", device="cpu", dtype=torch.float32, weights="random")
    lens = [3, 1, 5, 1, 2]
    for scheduling in ("static", "continuous"):
        llm = LLM(model, num_kv_blocks=16, max_num_seqs=2, scheduling=scheduling, enable_prefix_caching=False)
        llm.generate([[1 + i] * 20 for i in range(5)],
                     [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in lens], use_tqdm=False)
        assert llm.stats()["num_steps"] == steps_and_idle(lens, 2, scheduling == "static")[0]


def test_the_twenty_colleagues():
    """The scene: every colleague at full length fits a 24 GiB card's pool (five contracts would
    fill it); a decode step of eight on the H100 is bandwidth-bound and almost all weights; continuous
    batching leaves fewer slot-steps idle, takes fewer steps and starts everyone sooner."""
    card = plan(CFG, gpu_memory="24GiB", max_model_len=-1)
    assert sum(L.ceil_div(n + o, card.block_size) * card.block_size for n, o in zip(INPUTS, OUTPUTS)) <= card.tokens
    assert card.concurrent_requests(8192) == 5
    mean_ctx = round((sum(INPUTS) + sum(OUTPUTS) / 2) / 20)
    decode = L.decode_step(CFG, 8, mean_ctx, H100.bandwidth).floor(H100.bf16_flops)
    assert decode.bound == "memory" and L.weight_bytes(CFG) / decode.bytes > 0.9
    static, continuous = (L.slot_schedule(OUTPUTS, 8, static=s) for s in (True, False))
    (s_steps, s_idle), (c_steps, c_idle) = steps_and_idle(OUTPUTS, 8, True), steps_and_idle(OUTPUTS, 8, False)
    assert s_steps > c_steps >= L.ceil_div(sum(OUTPUTS), 8) and s_idle > c_idle
    assert sum(a for a, _ in static) > sum(a for a, _ in continuous)
    assert max(a for a, _ in static) > max(a for a, _ in continuous)


def test_more_places_leave_more_idle():
    """Exercise 1: sixteen places instead of eight leave a larger share of slot-steps idle under both."""
    for static in (True, False):
        assert steps_and_idle(OUTPUTS, 16, static)[1] > steps_and_idle(OUTPUTS, 8, static)[1]
    # continuous batching takes fewer steps with more places, down to the longest request's
    assert steps_and_idle(OUTPUTS, 16, False)[0] == max(OUTPUTS) < steps_and_idle(OUTPUTS, 8, False)[0]


def test_a_prompt_in_spans_costs_what_it_costs_whole():
    n = 8192
    assert L.prefill_chunk(CFG, 0, n, n).flops == L.prefill(CFG, n).flops
    spans = [(0, 2041), (2041, 4082), (4082, 6123), (6123, 8164), (8164, 8192)]
    assert sum(L.prefill_chunk(CFG, a, b, n).flops for a, b in spans) == L.prefill(CFG, n).flops
    # the output layer is billed once, with the span that ends the prompt
    assert L.prefill_chunk(CFG, 0, 100, n).flops == 100 * (L.matmul_flops_per_token(CFG) - L.output_layer_flops(CFG)) \
        + L.prefill_attention_flops(CFG, 100)


def test_the_contract_on_an_h100():
    """The page's table: budget 2,048, seven decoding at 1,024: five chunks of 2,041 (the last 28),
    each later one heavier, the first four compute-bound, the last one bandwidth-bound and about a
    decode step; the whole prompt is compute-bound (a step of a hundred-odd ms), the decode step
    bandwidth-bound, and the chunks together cost more than the whole. At vLLM's budget on an H100,
    8,192, the worst of two chunks is almost the whole."""
    steps = L.chunked_prefill(CFG, 8192, EngineConfig().max_num_batched_tokens, 7, 1024, H100.bf16_flops, H100.bandwidth)
    assert steps.chunk_count == math.ceil(8192 / 2041) == 5
    assert steps.spans[0] == (0, 2041) and steps.spans[-1] == (8164, 8192)
    decode = L.decode_step(CFG, 7, 1024, H100.bandwidth)
    assert (steps.decode.flops, steps.decode.bytes) == (decode.flops, decode.bytes)
    assert steps.decode.bound == "memory" and steps.whole.bound == "compute"
    assert steps.whole.flops == decode.flops + L.prefill(CFG, 8192).flops
    secs = [f.seconds for f in steps.chunks]
    assert secs[0] < secs[1] < secs[2] < secs[3] and secs[4] < secs[0] and steps.worst_chunk is steps.chunks[3]
    assert [f.bound for f in steps.chunks] == ["compute"] * 4 + ["memory"]
    assert steps.decode.seconds < secs[4] < 1.1 * steps.decode.seconds
    assert 0.1 < steps.whole.seconds < 0.2
    assert steps.chunked_seconds > steps.whole.seconds
    big = L.chunked_prefill(CFG, 8192, 8192, 7, 1024, H100.bf16_flops, H100.bandwidth)
    assert big.chunk_count == 2 and big.worst_chunk.seconds > 0.95 * steps.whole.seconds  # vLLM's budget on an H100
    with pytest.raises(ValueError):
        L.chunked_prefill(CFG, 100, 4, 4, 16, 1e12, 1e9)


def test_the_contract_on_an_h200():
    """Exercise 2: on the H200 the unchunked contract is more decode steps long than on the H100."""
    h100, h200 = (L.chunked_prefill(CFG, 8192, 2048, 7, 1024, g.bf16_flops, g.bandwidth) for g in (H100, lookup_gpu("H200")))
    assert h200.whole.seconds == pytest.approx(h100.whole.seconds)  # compute-bound: the same P
    assert h200.whole.seconds / h200.decode.seconds > h100.whole.seconds / h100.decode.seconds


def test_recompute_against_swap():
    """Recompute costs about the same multiple of swap at any context; the crossover bandwidth sits
    under PCIe 5.0 x16's 64 GB/s (swap is faster there); the default swap space holds four contracts.
    Exercise 3: PCIe 4.0's 32 GB/s sits between the GQA and the MHA crossover; Qwen2.5-7B's is lower."""
    ratios = [L.prefill(CFG, c).floor(H100.bf16_flops, H100.bandwidth).seconds / (2 * L.kv_bytes(CFG, c) / 64e9)
              for c in (1024, 8192)]
    assert all(r > 1 for r in ratios) and max(ratios) < 1.2 * min(ratios)  # about the same multiple

    def crossover(cfg):
        return 2 * L.kv_bytes_per_token(cfg) * H100.bf16_flops / L.matmul_flops_per_token(cfg)

    assert round(crossover(CFG) / 1e9, 1) == 17.3 < 64
    assert crossover(CFG.replace(num_kv_heads=CFG.num_heads)) > 32e9 > crossover(CFG)
    assert crossover(load_config("qwen2.5-7b")) < crossover(CFG)
    assert round(SWAP_SPACE_BYTES / L.kv_bytes(CFG, 8192)) == 4
