"""The diagnosis chapter's kit (minillm.lab.chapters.ch14_diagnose): the lab's scenarios as the
engine schedules them, and the numbers the page glues."""
import functools
from types import SimpleNamespace

import torch

from minillm.engine.config import load_config
from minillm.engine.loader import load_model
from minillm.lab import estimate as L
from minillm.lab.chapters import ch14_diagnose as kit
from minillm.lab.diagnose import Batching, ServerView
from minillm.lab.notebook import Lab


@functools.cache
def tiny_lab() -> Lab:
    cfg = load_config("tiny")
    model = load_model("tiny", device="cpu", dtype=torch.float32, weights="random")
    return Lab(torch.device("cpu"), "tiny", torch.float32, "cpu", cfg, model)


def test_the_scenarios_at_both_sizes():
    cpu, gpu = kit.scenarios(on_gpu=False), kit.scenarios(on_gpu=True)
    assert list(cpu) == ["long_prompts", "decode_heavy", "small_pool"]
    assert gpu["long_prompts"].inputs == (8192,) * 3 and cpu["long_prompts"].inputs == (2048,) * 3
    assert len(gpu["decode_heavy"].inputs) == 128 and len(cpu["decode_heavy"].inputs) == 4
    assert cpu["small_pool"].pool_tokens() == 3 * (256 + 32)
    roomy = kit.roomy(cpu["small_pool"])
    assert roomy.pool is None and roomy.pool_tokens() == 12 * 288  # 288 is a whole number of blocks


def test_the_cpu_decodes_are_few_enough_to_stay_bandwidth_bound():
    """Four tiny fp32 decodes do under 2 FLOP per byte: below a ridge of a few FLOP per byte."""
    cfg = load_config("tiny")
    step = L.decode_step(cfg, 4, 64, 1e10, "fp32")
    assert step.intensity < 2
    assert L.decode_step(cfg, 32, 64, 1e10, "fp32").intensity > 10


def test_the_scenarios_schedule_as_the_chapter_says(tmp_path, one_thread):
    lab, scene = tiny_lab(), kit.scenarios(on_gpu=False)
    heavy = kit.run_scenario(lab, scene["decode_heavy"], tmp_path / "heavy.json")
    assert heavy.batching.num_steps == 64 and heavy.batching.mean_decode_batch == 4
    assert sum(heavy.batching.waited_steps.values()) == 0
    small = kit.run_scenario(lab, scene["small_pool"], tmp_path / "small.json")
    assert small.wall == "capacity" and small.batching.waited_steps["kv_pool"] > 0
    assert small.latency.num_aborted == 0 and small.symptom != "failure"
    assert small.memory.kv_pool_tokens == 3 * 288
    long_run = kit.run_scenario(lab, scene["long_prompts"], tmp_path / "long.json")
    assert long_run.batching.waited_steps["token_budget"] > 0 and long_run.batching.waited_steps["kv_pool"] == 0
    assert (tmp_path / "long.json").is_file()


def test_the_page_numbers():
    words = kit.page_numbers()
    # two 24 GiB cards hold each token's half: 4.1 times the tokens of one (chapter 13's ledger)
    assert words["tp2_gain"] == "4.1"
    assert words["kv_blocked_share"] == "10%"
    assert not any(key.startswith(("moe_", "spec_", "tp_", "big_")) for key in words)  # their own chapters


def batching(decode_bytes_per_s: float, prefill_flops_per_s: float) -> Batching:
    """A schedule whose ceilings are 10 GB/s and 100 GFLOP/s, at the given measured rates."""
    return Batching(num_steps=10, busy_seconds=1.0, mean_batch=2.0, max_batch=2, mean_decode_batch=2.0,
                    max_num_seqs=8, queueing_share_of_ttft=0.0, mean_queueing=0.0,
                    waited_steps={"kv_pool": 0, "token_budget": 0}, prefill_time_share=0.5,
                    compute_bound_share=0.5, decode_bytes_per_s=decode_bytes_per_s,
                    prefill_flops_per_s=prefill_flops_per_s, bandwidth=1e10, peak_flops=1e11)


def test_the_ceiling_note_is_one_whole_sentence_per_case():
    under, over = batching(5e9, 5e10), batching(2e10, 2e11)
    assert kit.ceiling_note(under, under, "本机机器画像") == "两个利用率都在 100% 之下。差距来自几处，前面几章逐项量过："
    mfu = kit.ceiling_note(over, under, "本机机器画像")
    assert mfu.startswith("MFU 超过了 100%：算 prompt 的步实际达到 200.0 GFLOP/s，高于上限 100.0 GFLOP/s。")
    assert "本机机器画像里的矩阵乘速率" in mfu and "GB/s" not in mfu
    assert mfu.endswith("MBU 离 100% 的差距来自几处，前面几章逐项量过：")
    mbu = kit.ceiling_note(under, over, "规格表")
    assert mbu.startswith("MBU 超过了 100%：纯解码的步实际读了 20.0 GB/s，高于上限 10.0 GB/s。") and "规格表里的带宽" in mbu
    assert mbu.endswith("MFU 离 100% 的差距来自几处，前面几章逐项量过：")
    both = kit.ceiling_note(over, over, "本机机器画像")
    assert both.startswith("两个利用率都超过了 100%") and "200.0 GFLOP/s" in both and "20.0 GB/s" in both and "差距" not in both


def test_the_scale_note_names_the_scaling_only_on_the_cpu():
    gpu = kit.scenarios(on_gpu=True)
    assert kit.scale_note(gpu, gpu) == "请求的长度和个数都按 GPU 上的原样。"
    assert kit.scale_note(kit.scenarios(on_gpu=False), gpu) == (
        "这是 CPU，请求和输出的长度都缩小到 GPU 上的 1/4，“解码为主”的请求也从 128 个减到 4 个。")


def client(wall=None, mean_ttft=None, extra_ttft=None, metrics=True, preemptions=0, kv=0.5, waiting=None):
    """A client-side diagnosis with the given server view (``metrics=False``: none exported)."""
    sv = ServerView("minillm", preemptions, 0, kv, waiting, 2.0, mean_ttft, None, None) if metrics else None
    return SimpleNamespace(server_view=sv, wall=wall, extra_ttft=extra_ttft, latency=SimpleNamespace(ttft={"mean": 0.3}))


def test_the_client_wall_note_is_built_only_for_the_case_that_holds():
    assert kit.client_wall_note(client(metrics=False), "capacity") == (
        "服务器没有导出 /metrics，从客户端的记录判不出是哪堵墙（引擎的记录说是容量墙）。")
    assert kit.client_wall_note(client(), "capacity").startswith("从客户端的记录却判不出是哪堵墙（引擎的记录说是容量墙）")
    full = kit.client_wall_note(client("capacity", kv=1.0, waiting=9.0), "capacity")
    assert full == "从客户端的记录也判得出是容量墙：服务器的 KV 占用最高到了 100%，同时最多有 9 个请求在等。"
    preempted = kit.client_wall_note(client("capacity", preemptions=3, kv=None), "capacity")
    assert preempted.startswith("从客户端的记录也判得出是容量墙：服务器的计数里有 3 次抢占")


def test_the_client_extra_sentence_compares_the_same_run():
    assert kit.client_extra_sentence(client(metrics=False)).startswith("服务器的 /metrics 里没有它自己记的 TTFT")
    more = kit.client_extra_sentence(client(mean_ttft=0.25, extra_ttft=0.05))
    assert more == ("客户端量到的平均 TTFT 是 300.0 ms，同一次运行里服务器自己记的是 250.0 ms，"
                    "客户端多等的 50.0 ms 是网络、HTTP 和等下一步开始的时间。")
    less = kit.client_extra_sentence(client(mean_ttft=0.32, extra_ttft=-0.02))
    assert less.startswith("客户端量到的平均 TTFT 是 300.0 ms，同一次运行里服务器自己记的是 320.0 ms，客户端这边反而短了 20.0 ms")
