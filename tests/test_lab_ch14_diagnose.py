"""The diagnosis chapter's kit (minillm.lab.chapters.ch14_diagnose): the lab's scenarios as the
engine schedules them, and the numbers the page glues."""
import functools

import torch

from minillm.engine.config import load_config
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


def test_the_page_numbers():
    words = ch11.page_numbers()
    # two 24 GiB cards hold each token's half: 4.1 times the tokens of one (chapter 13's ledger)
    assert words["tp2_gain"] == "4.1"
    assert words["kv_blocked_share"] == "10%"
    assert not any(key.startswith(("moe_", "spec_", "tp_", "big_")) for key in words)  # their own chapters
