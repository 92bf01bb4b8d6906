"""Synthetic workloads and the throughput benchmark (chapter 调度)."""
import math
import statistics

import pytest
import torch

from minillm.lab.bench_throughput import (_hf_batch, _transformers_model, bench_throughput,
                                      format_throughput)
from minillm.engine.config import load_config, resolve_checkpoint
from minillm import LLM
from minillm.engine.loader import load_model
from minillm.engine.sampling import SamplingParams
from minillm.lab.workload import (Workload, chat_workload, contract_workload, lognormal_lengths,
                              make_workload, poisson_arrivals, random_prompts, throughput_workload,
                              uniform_lengths, uniform_workload)

VOCAB = 4096


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    times = poisson_arrivals(4000, rate=8.0, seed=3)
    assert times == poisson_arrivals(4000, rate=8.0, seed=3)
    assert times != poisson_arrivals(4000, rate=8.0, seed=4)
    assert all(b > a for a, b in zip(times, times[1:]))
    assert len(times) / times[-1] == pytest.approx(8.0, rel=0.05)
    assert poisson_arrivals(3, rate=math.inf) == [0.0, 0.0, 0.0]
    for rate in (0, -1.0):
        with pytest.raises(ValueError, match="rate"):
            poisson_arrivals(3, rate=rate)


def test_length_mixes():
    lengths = uniform_lengths(2000, 100, 1024, seed=1)
    assert min(lengths) >= 100 and max(lengths) <= 1024
    assert statistics.mean(lengths) == pytest.approx(562, rel=0.05)
    chat = lognormal_lengths(2001, median=200, sigma=1.0, low=4, high=4000, seed=2)
    assert statistics.median(chat) == pytest.approx(200, rel=0.1)
    assert min(chat) >= 4 and max(chat) <= 4000
    assert statistics.mean(chat) > statistics.median(chat)  # a long tail
    with pytest.raises(ValueError, match="length range"):
        uniform_lengths(3, 10, 5)
    with pytest.raises(ValueError, match="median"):
        lognormal_lengths(3, median=0, sigma=1.0)


def test_random_prompts_stay_in_the_vocabulary():
    prompts = random_prompts([1, 5, 30], vocab_size=7, seed=0)
    assert [len(p) for p in prompts] == [1, 5, 30]
    assert all(0 <= t < 7 for p in prompts for t in p)
    assert prompts == random_prompts([1, 5, 30], vocab_size=7, seed=0)


def test_contract_among_short_questions():
    w = contract_workload(VOCAB, num_requests=20, contract_len=8192, question_range=(16, 128),
                          output_len=32, rate=4.0)
    assert len(w) == 20
    assert w.input_lens[10] == 8192
    assert all(16 <= n <= 128 for i, n in enumerate(w.input_lens) if i != 10)
    assert w.output_lens == [32] * 20
    assert w.arrival_times == sorted(w.arrival_times) and w.arrival_times[0] > 0
    assert contract_workload(VOCAB, contract_index=0).input_lens[0] == 8192
    with pytest.raises(ValueError, match="contract_index"):
        contract_workload(VOCAB, num_requests=5, contract_index=5)


def test_standard_throughput_workload_and_its_scale():
    full = throughput_workload(VOCAB)
    assert len(full) == 256
    lengths = full.input_lens + full.output_lens
    assert min(lengths) >= 100 and max(lengths) <= 1024
    assert all(p.ignore_eos and p.temperature == 0 for p in full.params)
    assert full.arrival_times == [0.0] * 256
    small = throughput_workload(VOCAB, scale=0.125)
    assert len(small) == 32
    assert min(small.input_lens + small.output_lens) >= 12
    assert max(small.input_lens + small.output_lens) <= 128
    with pytest.raises(ValueError, match="scale"):
        throughput_workload(VOCAB, scale=0)


def test_workloads_check_their_shape():
    with pytest.raises(ValueError, match="one entry per request"):
        make_workload("x", [1, 2], [3], VOCAB)
    w = uniform_workload(4, VOCAB, (5, 9), (1, 3), rate=2.0, seed=0)
    assert isinstance(w, Workload) and len(w.prompts) == 4
    moved = w.with_arrivals([0.0, 0.0, 1.0, 2.0])
    assert moved.arrival_times == [0.0, 0.0, 1.0, 2.0] and moved.prompts == w.prompts
    with pytest.raises(ValueError, match="one entry per request"):
        w.with_arrivals([0.0])
    chat = chat_workload(50, VOCAB, max_len=300, seed=1)
    assert max(chat.input_lens + chat.output_lens) <= 300


def test_replay_on_the_engine_gives_every_request_its_tokens():
    cfg = load_config("tiny").replace(num_layers=1, hidden_size=64, intermediate_size=128,
                                      num_heads=4, num_kv_heads=2, head_dim=16)
    model = load_model(cfg, device="cpu", dtype=torch.float32, weights="random")
    w = uniform_workload(6, cfg.vocab_size, (3, 20), (1, 6), rate=200.0, seed=5)
    outputs = w.run(LLM(model, block_size=4, num_kv_blocks=64))
    assert [len(o.token_ids) for o in outputs] == w.output_lens
    first = outputs[0].metrics.arrival_time - w.arrival_times[0]
    for out, offset in zip(outputs, w.arrival_times):
        assert out.metrics.arrival_time - first == pytest.approx(offset)


def test_bench_throughput_runs_both_engines_on_the_same_work():
    result = bench_throughput("tiny", device="cpu", num_requests=200, scale=0.02, hf_batch_size=2)
    w = result["workload"]
    assert w["num_requests"] == 4
    for name in ("minillm", "transformers"):
        assert result[name]["output_tokens"] == w["output_tokens"]
        assert result[name]["output_throughput"] == result[name]["output_tokens"] / result[name]["seconds"]
    assert result["ratio"] == (result["minillm"]["output_throughput"]
                               / result["transformers"]["output_throughput"])
    assert "minillm / transformers" in format_throughput(result)
    single = result["single"]
    assert single["ratio"] == (single["minillm"]["output_throughput"]
                               / single["transformers"]["output_throughput"])
    assert len(single["minillm"]["runs"]) == 3 and single["input_tokens"] == 8
    with pytest.raises(ValueError, match="a preset, a folder"):
        bench_throughput("no-such-model")


def test_the_benchmark_gives_transformers_the_same_model():
    """Left-padded static batches in transformers compute the same greedy tokens as minillm."""
    net = load_model("tiny", device="cpu", dtype=torch.float64, weights="random")
    hf = _transformers_model(resolve_checkpoint("tiny"), net)
    prompts = random_prompts([7, 3, 12], net.config.vocab_size, seed=1)
    theirs = _hf_batch(hf, prompts, 5)[:, -5:].tolist()
    ours = LLM(net, block_size=4, num_kv_blocks=32).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert theirs == [o.token_ids for o in ours]
