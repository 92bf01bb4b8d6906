"""What chapter 混合专家 (book/ch12-moe.md) says of Mixtral-8x7B and Qwen3-30B-A3B from their shipped
configs: parameters, the experts a batch touches, the bytes a decode step reads (no idle expert, no
embedding table) and its floor on the H100, MBU three ways, what fits a card, and the exercises."""
from dataclasses import replace

import pytest

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.gpus import lookup_gpu

MIX, QWEN = load_config("mixtral-8x7b"), load_config("qwen3-30b-a3b")
H100 = lookup_gpu("H100 SXM")


def read(cfg, batch):
    return L.decode_read_bytes(cfg, experts=L.experts_touched(cfg, batch))


def floor(cfg, batch, weights=None):
    step = L.decode_step(cfg, batch, 1024, H100.bandwidth)
    nbytes = (read(cfg, batch) if weights is None else weights) + step.kv_read_bytes
    return L.roofline_floor(step.flops, nbytes, H100.bf16_flops, H100.bandwidth)


def test_total_and_active_parameters():
    assert [round(L.param_count(c) / 1e9, 1) for c in (MIX, QWEN)] == [46.7, 30.5]
    assert [round(L.active_param_count(c) / 1e9, 1) for c in (MIX, QWEN)] == [12.9, 3.4]
    assert L.active_param_count(QWEN) == L.param_count(QWEN) - 48 * 120 * 3 * 2048 * 768


def test_a_step_reads_every_weight_but_the_idle_experts_and_the_embedding_table():
    table, expert = 32000 * 4096 * 2, 3 * 4096 * 14336 * 2
    assert L.decode_read_bytes(MIX) == L.weight_bytes(MIX) - table
    assert read(MIX, 1) == pytest.approx(L.weight_bytes(MIX) - table - 32 * 6 * expert)
    assert L.decode_read_bytes(MIX, experts=8) == L.decode_read_bytes(MIX)  # every expert touched
    assert round(read(MIX, 64) / 1e9, 1) == round(L.decode_read_bytes(MIX) / 1e9, 1)  # "no different from all"


def test_the_share_of_the_weights_a_step_reads():
    """The figure: Mixtral starts near three tenths and is at 1 by batch 16; Qwen3-30B-A3B starts
    near a tenth, rises slowly and nears 1 only from batch 64 on. The embedding table is a hundredth
    of Mixtral's batch-1 read and a tenth of Qwen's (its vocabulary is larger): counting it matters."""
    share = {c.name: {b: read(c, b) / L.decode_read_bytes(c) for b in (1, 16, 32, 64)} for c in (MIX, QWEN)}
    assert 0.25 < share["mixtral-8x7b"][1] < 0.35 and share["mixtral-8x7b"][16] > 0.98
    assert 0.08 < share["qwen3-30b-a3b"][1] < 0.12 and share["qwen3-30b-a3b"][32] < 0.95 < share["qwen3-30b-a3b"][64]
    table = {c.name: L.param_breakdown(c)["embedding"] * 2 / read(c, 1) for c in (MIX, QWEN)}
    assert table["mixtral-8x7b"] < 0.02 and 0.05 < table["qwen3-30b-a3b"] < 0.15


def test_half_the_experts_at_batch_4_and_16():
    assert L.experts_touched(MIX, 2) < 4 <= L.experts_touched(MIX, 4)
    assert L.experts_touched(QWEN, 8) < 64 <= L.experts_touched(QWEN, 16)


def test_every_step_of_the_table_is_bandwidth_bound_and_mixtral_slows_about_fourfold():
    for cfg in (MIX, QWEN):
        assert all(floor(cfg, b).bound == "memory" for b in (1, 2, 4, 8, 16, 32, 64, 128, 256))
    assert 3.9 < floor(MIX, 64).seconds / floor(MIX, 1).seconds < 4.1


def test_mbu_with_the_wrong_numerators():
    def mbu(cfg, batch, numerator):
        return numerator / (2 * floor(cfg, batch).seconds) / H100.bandwidth

    kv = L.kv_bytes(QWEN, 1024)
    assert mbu(QWEN, 1, read(QWEN, 1) + kv) == pytest.approx(0.5)
    assert mbu(QWEN, 1, L.decode_read_bytes(QWEN) + kv) > 2  # "far above 100%"
    table = L.weight_bytes(MIX) - L.decode_read_bytes(MIX)
    assert mbu(MIX, 64, 2 * L.active_param_count(MIX) - table + 64 * L.kv_bytes(MIX, 1024)) < 0.25


def test_what_fits_a_card():
    def fits(nbytes, gib):
        return nbytes <= 0.92 * gib * L.GiB

    assert not fits(L.weight_bytes(MIX), 80)
    fit24 = [(c.name, q) for c in (MIX, QWEN) for q in (None, "int8", "int4") if fits(L.weight_bytes(c, "bf16", q), 24)]
    assert fit24 == [("qwen3-30b-a3b", "int4")]


def test_exercises():
    twin = replace(MIX, name="twin", model_type="mistral", intermediate_size=2 * MIX.intermediate_size,
                   num_experts=0, num_experts_per_tok=0, norm_topk_prob=False)
    assert abs(L.param_count(twin) - L.active_param_count(MIX)) / L.active_param_count(MIX) < 0.001
    ratio = [floor(MIX, b).seconds / floor(twin, b, L.decode_read_bytes(twin)).seconds for b in (1, 64)]
    assert abs(ratio[0] - 1) < 0.01 and 2.5 < ratio[1] < 4  # "almost the same", then "several times"
    budget = 0.92 * 24 * L.GiB
    qwen = (budget - L.weight_bytes(QWEN, "bf16", "int4")) // L.kv_bytes(QWEN, 4096)
    llama8b = load_config("llama-3.1-8b")
    llama = (budget - L.weight_bytes(llama8b)) // L.kv_bytes(llama8b, 4096)
    assert qwen < llama  # "the 8B holds more"
    assert L.kv_bytes_per_token(QWEN) < L.kv_bytes_per_token(llama8b) and L.weight_bytes(QWEN, "bf16", "int4") > L.weight_bytes(llama8b)
