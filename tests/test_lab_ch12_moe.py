"""The MoE chapter's kit (minillm.lab.chapters.ch12_moe): the ledger of Mixtral-8x7B and
Qwen3-30B-A3B under the chapter's one convention on the bytes a step reads, MBU three ways, what
the experts take of a card; the lab's dense twin, its router biased hot, and a real sweep of a
small MoE whose experts touched are counted from MoE.expert_tokens."""
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402

from minillm.engine.config import load_config  # noqa: E402
from minillm.lab import estimate as L  # noqa: E402
from minillm.lab.chapters import ch12_moe as ch12  # noqa: E402
from minillm.lab.estimate import GiB  # noqa: E402
from minillm.lab.gpus import lookup_gpu  # noqa: E402
from minillm.lab.notebook import Lab  # noqa: E402

MIX, QWEN = load_config("mixtral-8x7b"), load_config("qwen3-30b-a3b")
H100 = lookup_gpu("H100 SXM")
CPU = Lab(torch.device("cpu"), "moe-test", torch.float32, "cpu", ch12.LAB_MOE, None)
TINY_MOE = replace(ch12.LAB_MOE, name="tiny-moe", vocab_size=128, hidden_size=32, intermediate_size=16,
                   num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2)


def test_the_two_ledgers_from_the_shipped_configs():
    assert round(L.param_count(MIX) / 1e9, 1) == 46.7 and round(L.active_param_count(MIX) / 1e9, 1) == 12.9
    assert round(L.param_count(QWEN) / 1e9, 1) == 30.5
    assert L.active_param_count(QWEN) == L.param_count(QWEN) - 48 * 120 * 3 * 2048 * 768
    rows = ch12.ledger_rows(ch12.models())
    assert rows[0][1] == "8 选 2" and rows[1][1] == "128 选 8" and rows[0][6] == "97%"


def test_a_step_reads_every_weight_but_the_idle_experts_and_the_embedding_table():
    table, expert = 32000 * 4096 * 2, 3 * 4096 * 14336 * 2
    assert ch12.weights_read(MIX, 1) == pytest.approx(L.weight_bytes(MIX) - table - 32 * 6 * expert)
    assert ch12.weights_read(MIX, 10**6) == pytest.approx(L.weight_bytes(MIX) - table)
    # the experts really run: k per layer is batch 1, all of them is everything but the table
    assert ch12.weights_read_counted(QWEN, [8] * 48) == pytest.approx(ch12.weights_read(QWEN, 1))
    assert ch12.weights_read_counted(QWEN, [128] * 48) == L.weight_bytes(QWEN) - 151936 * 2048 * 2
    with pytest.raises(ValueError, match="one count"):
        ch12.weights_read_counted(QWEN, [8] * 47)
    with pytest.raises(ValueError, match="one count"):
        ch12.weights_read_counted(QWEN, [129] * 48)


def test_the_floor_rises_with_the_experts_touched_and_stays_bandwidth_bound():
    P, W = H100.bf16_flops, H100.bandwidth
    one, many = ch12.step(MIX, 1, P, W), ch12.step(MIX, 64, P, W)
    assert one.bytes == pytest.approx(ch12.weights_read(MIX, 1) + L.kv_bytes(MIX, 1024))
    assert many.flops == pytest.approx(64 * one.flops)
    assert one.bound == many.bound == "memory"
    assert 3.9 < many.seconds / one.seconds < 4.1  # 8 experts instead of 2, and 64 requests' KV
    rows = ch12.floor_rows({"q": QWEN}, P, W, batches=(1, 10**6))
    assert rows[0][1] == f"{(L.weight_bytes(QWEN) - 151936 * 2048 * 2 - 48 * 120 * L.expert_bytes(QWEN)) / 1e9:.1f} GB"
    assert rows[1][1] == f"{(L.weight_bytes(QWEN) - 151936 * 2048 * 2) / 1e9:.1f} GB" and "（带宽：M/W）" in rows[0][2]


def test_mbu_three_ways():
    P, W = H100.bf16_flops, H100.bandwidth
    one = ch12.mbu_three_ways(QWEN, 1, 2 * ch12.step(QWEN, 1, P, W).seconds, W)
    assert one["read"] == pytest.approx(0.5) and one["active"] == pytest.approx(0.5) and one["total"] > 4
    many = ch12.mbu_three_ways(MIX, 64, 2 * ch12.step(MIX, 64, P, W).seconds, W)
    assert many["read"] == pytest.approx(0.5) and many["total"] == pytest.approx(0.5, abs=1e-6)
    assert many["active"] < 0.2


def test_what_the_experts_take_of_a_card():
    assert ch12.all_experts_bytes(MIX) == 32 * 8 * 3 * 4096 * 14336 * 2
    assert not ch12.fits(L.weight_bytes(MIX), 80) and ch12.fits(L.weight_bytes(MIX, "bf16", "int8"), 80)
    assert ch12.fits(L.weight_bytes(QWEN, "bf16", "int4"), 24) and not ch12.fits(L.weight_bytes(QWEN, "bf16", "int8"), 24)
    rows = ch12.card_rows(ch12.models())
    assert [r[1] for r in rows] == ["bf16", "int8", "int4"] * 2
    assert rows[0][5].endswith("（放不下）") and rows[5][4].endswith("（放得下）")
    assert rows[3][3] == f"{48 * 128 * 3 * 2048 * 768 * 2 / GiB:.1f} GiB"


def test_the_dense_twin_runs_as_many_weights_per_token():
    twin = ch12.dense_twin(ch12.LAB_MOE)
    assert not twin.is_moe and twin.intermediate_size == 2 * 768
    router = 2 * 32 * 512
    assert L.param_count(twin) == L.active_param_count(ch12.LAB_MOE) - router


def test_a_sweep_counts_the_experts_each_layer_ran():
    model = ch12.load(CPU, TINY_MOE)
    points = ch12.sweep(model, batches=(1, 16), ctx=8, steps=1, rounds=2)
    one, many = points
    assert one.touched == [2, 2] and one.mean_touched == 2
    assert all(sum(layer) == 16 * 2 for layer in many.expert_tokens)
    assert all(2 < n <= 8 for n in many.touched)
    assert many.imbalance == pytest.approx(sum(max(layer) * 8 / 32 for layer in many.expert_tokens) / 2)
    assert one.seconds > 0 and many.seconds > 0
    floor = ch12.lab_floor(TINY_MOE, many, CPU.profile, "float32")
    assert floor.bytes == pytest.approx(ch12.weights_read_counted(TINY_MOE, many.touched, "float32")
                                        + 16 * L.kv_bytes(TINY_MOE, ch12.LAB_CTX, "float32"))


def test_heat_biases_the_router_towards_its_first_experts():
    model = ch12.load(CPU, TINY_MOE)
    before = [layer.gate.weight.clone() for layer in ch12.moe_layers(model)]
    ch12.heat(model, experts=2, scale=3.0)
    for w, layer in zip(before, ch12.moe_layers(model)):
        assert torch.equal(layer.gate.weight[:2], 3.0 * w[:2]) and torch.equal(layer.gate.weight[2:], w[2:])
    hot = ch12.sweep(model, batches=(64,), ctx=8, steps=1, rounds=1)[0]
    assert all(layer[0] + layer[1] > 64 * 2 * 2 / 8 for layer in hot.expert_tokens)  # above their uniform share


def test_the_sweep_table():
    pts = [ch12.Point(1, 0.002, ((1, 1, 0, 0), (0, 1, 1, 0))), ch12.Point(4, 0.004, ((2, 2, 2, 2), (4, 2, 2, 0)))]
    cfg = replace(TINY_MOE, num_experts=4)
    dense = [ch12.Point(1, 0.001), ch12.Point(4, 0.0015)]
    rows = ch12.sweep_rows(cfg, pts, dense, CPU.profile, "float32")
    assert rows[1][2] == "3.5" and rows[1][4] == "2.00" and rows[1][5] == "1.75" and rows[1][6] == "1.14"
    assert rows[1][9] == "1.5 ms"
    assert ch12.skew_rows(cfg, pts, pts)[1][4] == f"{(2 * 4 / 8 + 4 * 4 / 8) / 2:.1f}"


def test_the_rebound_note_fits_the_ratio_and_the_bound():
    assert ch12.rebound_note([1.0, 0.8, 0.7], "compute").startswith("这一次“两者之比”在最大的批上没有回升")
    assert ch12.rebound_note([1.0, 0.7, 0.9], "compute") == "“两者之比”在最大的批上回升：时间比专家数涨得更快，多出来的是运算。"
    memory = ch12.rebound_note([1.0, 0.7, 0.9], "memory")
    assert memory.startswith("“两者之比”在最大的批上回升") and "仍由带宽决定" in memory and "多出来的是运算" not in memory


def test_the_batch1_cache_note_has_a_sentence_for_an_unknown_cache():
    assert ch12.b1_cached_note(5e6, None).startswith("本机最大一级缓存有多大，这次没查到")
    assert ch12.b1_cached_note(5e6, 32_000_000).startswith("批 1 的一步读的字节比本机最大一级缓存（32 MB）还少")
    assert ch12.b1_cached_note(5e7, 32_000_000) == "批 1 的一步也比本机最大一级缓存大，重复计时的每一遍都要从内存里读。"
