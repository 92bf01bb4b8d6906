"""The memory lab's kit (minillm.lab.chapters.ch06_memory): the planner's breakdown in Chinese,
its refusals in Chinese, the CPU card, the deductions from the ledger to the plan, the diagram."""
import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402

from minillm.engine.config import load_config  # noqa: E402
from minillm.engine.memory_plan import MemoryPlanError  # noqa: E402
from minillm.engine.planner import plan  # noqa: E402
from minillm.engine.units import GiB, MiB, fmt_int  # noqa: E402
from minillm.lab import estimate as L  # noqa: E402
from minillm.lab.chapters import ch06_memory as ch06  # noqa: E402

CFG = load_config("llama-3.1-8b")
DRY = plan(CFG, gpu_memory="24GiB", max_model_len=-1)


def test_plan_rows_in_chinese_carry_the_plans_numbers():
    rows = dict((k, v) for k, v in ch06.plan_rows(DRY))
    assert rows["KV 块数"] == fmt_int(DRY.num_blocks) and rows["KV token 数"] == fmt_int(DRY.tokens)
    assert rows["来源"] == "干跑（公式估算）" and rows["max_model_len"] == fmt_int(DRY.max_model_len)
    assert rows["同时在跑的请求 @ctx 8,192"] == fmt_int(DRY.concurrent_requests(8192))
    assert len(ch06.plan_rows(DRY)) == len(DRY.rows()) and rows["权重"].startswith(fmt_int(DRY.weight_bytes))


def test_refusals_in_chinese():
    with pytest.raises(MemoryPlanError) as full:
        plan(CFG, gpu_memory="24GiB", max_model_len=CFG.max_position_embeddings)
    words = ch06.plan_error_words(full.value)
    assert fmt_int(full.value.max_model_len_that_fits) in words and fmt_int(DRY.tokens) in words
    assert full.value.max_model_len_that_fits == DRY.max_model_len
    with pytest.raises(MemoryPlanError) as small:
        plan(CFG, gpu_memory="16GiB", max_model_len=8192)
    assert ch06.plan_error_words(small.value).startswith("权重")


def test_the_cpu_card_holds_four_and_a_half_requests():
    args = dict(block_size=16, max_num_batched_tokens=256, max_num_seqs=32, gpu_memory_utilization=0.92)
    card, sizing = ch06.cpu_card(load_config("tiny"), args, 256, torch.float32)
    assert card % MiB == 0
    needed = sizing.weight_bytes + sizing.activation_peak_bytes + 4.5 * 16 * sizing.bytes_per_block
    assert needed <= card * 0.92 < needed + MiB


def test_deductions_add_up_from_the_ledger_to_the_plan():
    rows = ch06.deductions(DRY)
    ledger = L.memory_budget(CFG, "24GiB", 0.92)
    assert rows[0][3] == fmt_int(ledger.kv_budget_bytes / L.kv_bytes_per_token(CFG))
    assert rows[-1][2] == rows[-1][3] == rows[-2][3] == fmt_int(DRY.tokens)
    assert rows[1][1] == "0 B"  # the weights a dry run counts are the ledger's


def test_budget_diagram_is_legible():
    fig = ch06.budget_diagram(L.memory_budget(CFG, "24GiB", 0.92), DRY)
    texts = [t for t in fig.axes[0].texts if t.get_text()]
    assert len(texts) == 8 and min(t.get_fontsize() for t in texts) >= 10
    # the figure is narrow enough that 10 pt stays >= 12 px when a 730 px column shows it
    assert 10 / 72 * 730 / fig.get_figwidth() >= 12
    assert any(fmt_int(DRY.num_blocks) in t.get_text() for t in texts)
    assert 24 * GiB == DRY.total_bytes
