"""The diagnosis chapter's kit (minillm.lab.chapters.ch14_diagnose): the lab's scenarios as the
engine schedules them, and the page's ledger of tensor parallelism,
each step a floor max(F/P, M/W)."""
import functools

import pytest
import torch

from minillm.engine.config import ModelConfig, load_config
from minillm.engine.loader import load_model
from minillm.lab import estimate as L
from minillm.lab.chapters import ch14_diagnose as ch11
from minillm.lab.notebook import Lab


@functools.cache
def tiny_lab() -> Lab:
    cfg = load_config("tiny")
    model = load_model("tiny", device="cpu", dtype=torch.float32, weights="random")
    return Lab(torch.device("cpu"), "tiny", torch.float32, "cpu", cfg, model)


def test_the_scenarios_at_both_sizes():
    cpu, gpu = ch11.scenarios(on_gpu=False), ch11.scenarios(on_gpu=True)
    assert list(cpu) == ["long_prompts", "decode_heavy", "small_pool"]
    assert gpu["long_prompts"].inputs == (8192,) * 3 and cpu["long_prompts"].inputs == (2048,) * 3
    assert len(gpu["decode_heavy"].inputs) == 128 and len(cpu["decode_heavy"].inputs) == 4
    assert cpu["small_pool"].pool_tokens() == 3 * (256 + 32)
    roomy = ch11.roomy(cpu["small_pool"])
    assert roomy.pool is None and roomy.pool_tokens() == 12 * 288  # 288 is a whole number of blocks


def test_the_cpu_decodes_are_few_enough_to_stay_bandwidth_bound():
    """Four tiny fp32 decodes do under 2 FLOP per byte: below a ridge of a few FLOP per byte."""
    cfg = load_config("tiny")
    step = L.decode_step(cfg, 4, 64, 1e10, "fp32")
    assert step.intensity < 2
    assert L.decode_step(cfg, 32, 64, 1e10, "fp32").intensity > 10


def test_the_scenarios_schedule_as_the_chapter_says(tmp_path, one_thread):
    lab, scene = tiny_lab(), ch11.scenarios(on_gpu=False)
    heavy = ch11.run_scenario(lab, scene["decode_heavy"], tmp_path / "heavy.json")
    assert heavy.batching.num_steps == 64 and heavy.batching.mean_decode_batch == 4
    assert sum(heavy.batching.waited_steps.values()) == 0
    small = ch11.run_scenario(lab, scene["small_pool"], tmp_path / "small.json")
    assert small.wall == "capacity" and small.batching.waited_steps["kv_pool"] > 0
    assert small.latency.num_aborted == 0 and small.symptom != "failure"
    assert small.memory.kv_pool_tokens == 3 * 288
    long_run = ch11.run_scenario(lab, scene["long_prompts"], tmp_path / "long.json")
    assert long_run.batching.waited_steps["token_budget"] > 0 and long_run.batching.waited_steps["kv_pool"] == 0
    assert (tmp_path / "long.json").is_file()


def test_tensor_parallel_splits_weights_and_kv_heads():
    cfg = load_config("llama-3.1-8b")
    one, two = ch11.tensor_parallel(cfg, 1), ch11.tensor_parallel(cfg, 2)
    assert two.weight_bytes == L.weight_bytes(cfg) / 2 and two.kv_bytes_per_token == L.kv_bytes_per_token(cfg) / 2
    assert one.allreduce_bytes == 0 and one.syncs == 0 and two.syncs == 64
    assert two.allreduce_bytes == 32 * 2 * 2 * 0.5 * 4096 * 2
    assert two.step.seconds == pytest.approx(one.step.seconds / 2)
    # beyond its 8 KV heads, each card keeps a copy
    assert ch11.tensor_parallel(cfg, 16).kv_bytes_per_token == L.kv_bytes_per_token(cfg) / 8
    big = ModelConfig(**ch11.LLAMA_70B)
    assert not ch11.tensor_parallel(big, 1).fits and ch11.tensor_parallel(big, 2).fits


def test_the_page_numbers():
    words = ch11.page_numbers()
    assert words["tp_min_big"] == "2"
    assert not any(key.startswith("moe_") for key in words)  # MoE has its chapter
    assert not any(key.startswith("spec_") for key in words)  # speculative decoding has its chapter
    assert words["big_params"] == "70.6B"
