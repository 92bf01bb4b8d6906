"""The quantization lab's kit (minillm.lab.chapters.ch10_quantization): bytes per weight, the bytes a
decode step reads, the compute-bound batch, the 24 GiB dry run per format, serving at an SLO, cost,
the published anchors beside the ledger, one linear per format, and the speed rows."""
import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402

from minillm.engine.config import load_config  # noqa: E402
from minillm.lab import estimate as L  # noqa: E402
from minillm.lab.chapters import ch10_quantization as ch10  # noqa: E402
from minillm.lab.chapters.ch10_quantization import BASELINE, Format  # noqa: E402
from minillm.lab.gpus import lookup_gpu  # noqa: E402

CFG, SMALL = load_config("llama-3.1-8b"), load_config("smollm2-135m")
H100, RTX = lookup_gpu("H100 SXM"), lookup_gpu("RTX 4090")


def test_bytes_per_weight_count_the_group_parameters():
    assert ch10.bytes_per_weight(None) == 2.0 and ch10.bytes_per_weight(None, dtype="fp32") == 4.0
    assert ch10.bytes_per_weight("int8") == 1 + 4 / 4096
    assert ch10.bytes_per_weight("int4", 32) == 0.5 + 4 / 32 == 0.625
    assert ch10.bytes_per_weight("int4", 128) == 0.5 + 4 / 128


def test_decode_reads_no_embedding_table_unless_it_is_the_output_layer():
    table = L.param_breakdown(SMALL)["embedding"] * 4
    assert SMALL.tie_word_embeddings
    assert ch10.decode_read_bytes(SMALL, "fp32") == L.weight_bytes(SMALL, "fp32")  # tied: the table is read
    assert ch10.decode_read_bytes(SMALL, "fp32", "int4") == L.weight_bytes(SMALL, "fp32", "int4") - table
    assert not CFG.tie_word_embeddings  # untied: the table is never read whole
    assert ch10.decode_read_bytes(CFG) == L.weight_bytes(CFG) - L.param_breakdown(CFG)["embedding"] * 2


@pytest.mark.parametrize("fmt", [BASELINE, Format("int8"), Format("int4"), Format("int4", "fp8")])
def test_compute_bound_batch_is_where_the_floor_turns(fmt):
    batch = ch10.compute_bound_batch(CFG, H100, fmt, 128)
    assert ch10.step(CFG, H100, fmt, batch, 128).floor(H100.bf16_flops).bound == "compute"
    assert ch10.step(CFG, H100, fmt, batch - 1, 128).floor(H100.bf16_flops).bound == "memory"
    assert ch10.compute_bound_batch(CFG, H100, fmt, 4096) is None  # the KV's intensity stays below the ridge


def test_fewer_bytes_per_weight_cross_the_ridge_at_a_smaller_batch():
    batches = [ch10.compute_bound_batch(CFG, H100, Format(q), 128) for q in (None, "int8", "int4")]
    assert batches[0] > batches[1] > batches[2]
    assert batches[0] / batches[2] > 2.5


def test_the_24gib_grid_fp8_doubles_the_blocks_and_int4_frees_the_weights():
    dry = ch10.plans(CFG)
    assert list(dry) == list(ch10.GRID) and len(dry) == 6
    base, fp8, int4 = dry[BASELINE], dry[Format(kv_cache_dtype="fp8")], dry[Format("int4")]
    assert fp8.num_blocks in (2 * base.num_blocks, 2 * base.num_blocks + 1)
    assert int4.weight_bytes == L.weight_bytes(CFG, "bf16", "int4", 32)
    assert int4.tokens > fp8.tokens > base.tokens
    rows = ch10.plan_rows(dry)
    assert rows[0][5] == "1.00×" and rows[1][2] == "64 KiB" and rows[0][2] == "128 KiB"
    assert rows[4][4] == f"{int4.tokens:,}"


def test_serving_at_an_slo_takes_the_largest_batch_that_fits_both():
    dry = ch10.plans(CFG, formats=(BASELINE,))
    batch, tok_s = ch10.slo_serving(CFG, RTX, BASELINE, dry[BASELINE], 4096)
    floor = ch10.step(CFG, RTX, BASELINE, batch, 4096).floor(RTX.bf16_flops)
    assert batch == dry[BASELINE].concurrent_requests(4096) and floor.seconds <= ch10.SLO_STEP_SECONDS
    assert tok_s == pytest.approx(batch / floor.seconds)
    tight, _ = ch10.slo_serving(CFG, RTX, BASELINE, dry[BASELINE], 4096, slo=0.018)
    assert ch10.step(CFG, RTX, BASELINE, tight, 4096).floor(RTX.bf16_flops).seconds <= 0.018
    assert ch10.step(CFG, RTX, BASELINE, tight + 1, 4096).floor(RTX.bf16_flops).seconds > 0.018
    assert ch10.slo_serving(CFG, RTX, BASELINE, dry[BASELINE], 4096, slo=1e-3) == (0, 0.0)


def test_cost_per_million_tokens():
    assert ch10.cost_per_million(1000, 3.6) == pytest.approx(1.0)  # 3.6 M tokens an hour for 3.6 $
    with pytest.raises(ValueError):
        ch10.cost_per_million(0, 2.0)


def test_gpt_fast_bytes_per_token_match_the_ledger():
    rows = ch10.gpt_fast_rows(load_config("llama-2-7b"))
    assert [r[0] for r in rows] == ["bf16", "int8", "int4"]
    assert rows[0][3] == "13.32 GB" and rows[0][4] == "13.48 GB"
    assert rows[2][5] == "1.88×" and rows[2][6] == "3.03×"


def test_labels_name_weights_and_kv():
    assert Format("int4", "fp8").label() == "int4（每组 32） 权重 + fp8 KV"
    assert BASELINE.label("fp32") == "fp32 权重 + fp32 KV"
    assert Format("int4", "fp8").tick() == "int4 权重\nfp8 KV"


def test_the_tokens_figure_labels_every_bar_with_the_plan():
    dry = ch10.plans(CFG)
    fig = ch10.plot_tokens(dry)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == [f"{p.tokens:,}" for p in dry.values()]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [f.tick() for f in dry]


def test_one_linear_per_format_streams_its_own_bytes():
    rows = ch10.time_linears(torch.device("cpu"), shape=(256, 512), repeats=3)
    assert [r["layer"].split("（")[0].split(" ")[0] for r in rows] == ["fp32", "bf16", "int8", "int4"]
    assert [r["bytes"] for r in rows] == [4 * 256 * 512, 2 * 256 * 512, 256 * 512 + 4 * 256, 256 * 256 + 4 * 256 * 16]
    assert all(r["bandwidth"] == pytest.approx(r["bytes"] / r["seconds"]) for r in rows)


def test_speed_rows_share_the_run_s_one_baseline():
    def point(variant, batch, median, nbytes, kv, speedup=None):
        p = {"variant": variant, "batch": batch, "ctx": 256, "median_s": median,
             "estimate": {"bytes": nbytes, "kv_read_bytes": kv}}
        return p if speedup is None else {**p, "speedup": speedup}
    kv = L.kv_bytes(SMALL, 256, "fp32")
    w = L.weight_bytes(SMALL, "fp32"), L.weight_bytes(SMALL, "fp32", "int4"), L.weight_bytes(SMALL, "fp32", "int8")
    points = [point("baseline", 1, 0.06, w[0] + kv, kv), point("int4", 1, 0.02, w[1] + kv, kv, 3.0),
              point("int8", 1, 0.03, w[2] + kv, kv, 2.0)]
    int4, int8 = ch10.speed_rows({"formats": (Format("int4"), Format("int8")), "points": points}, SMALL, "fp32")
    assert int4["speedup"] == 3.0 and int4["baseline_ms"] == pytest.approx(60) and int4["ms"] == pytest.approx(20)
    assert int8["format"] == Format("int8") and int8["ms"] == pytest.approx(30)
    assert ch10.baselines([int4, int8]) == {1: pytest.approx(60)}
    assert int4["ledger_ratio"] == pytest.approx((w[0] + kv) / (w[1] + kv))
    read = (ch10.decode_read_bytes(SMALL, "fp32") + kv) / (ch10.decode_read_bytes(SMALL, "fp32", "int4") + kv)
    assert int4["read_ratio"] == pytest.approx(read) and int4["read_ratio"] > int4["ledger_ratio"]


def test_speedup_sentences_are_chosen_by_the_numbers():
    assert ch10.speedup_sentence({"speedup": 3.0, "read_ratio": 3.4}, True, "fp32").startswith("实测加速接近")
    assert ch10.speedup_sentence({"speedup": 1.2, "read_ratio": 3.4}, True, "fp32").startswith("实测加速明显低于")
    assert "更慢" in ch10.speedup_sentence({"speedup": 0.7, "read_ratio": 1.01}, True, "fp32")
    assert "解释不了" in ch10.speedup_sentence({"speedup": 1.2, "read_ratio": 1.01}, True, "fp32")
    assert "没有明显的加速" in ch10.speedup_sentence({"speedup": 1.0, "read_ratio": 1.01}, True, "fp32")
    assert "fp32 矩阵乘本身就读得慢" in ch10.speedup_sentence({"speedup": 4.5, "read_ratio": 3.7}, True, "fp32")
    assert "重测" in ch10.speedup_sentence({"speedup": 4.5, "read_ratio": 3.7}, False, "fp32")
    assert "重测" in ch10.speedup_sentence({"speedup": 4.5, "read_ratio": 3.7}, True, "bf16")  # no fp32 baseline to blame


def test_quality_sentence_follows_which_perplexity_rose_more():
    assert ch10.quality_sentence(1.004, 1.001).startswith("于是字节多一倍的 int8，困惑度反而比 int4 涨得多")
    assert ch10.quality_sentence(1.001, 1.004).startswith("可这一次量到的 int8 困惑度涨得并不比 int4 多")


def test_linear_sentences_compare_bandwidths_and_the_baseline_dtype():
    assert "和 int4 层相当" in ch10.lin_int8_sentence(10e9, 11e9)
    assert "和 int4 层相当" in ch10.lin_int8_sentence(12e9, 10e9)
    assert "远少于 int4 层" in ch10.lin_int8_sentence(7e9, 10e9)
    assert "比 int4 层多得多" in ch10.lin_int8_sentence(13e9, 10e9)
    assert ch10.lin_bf16_sentence(2e-3, 1e-3, "fp32") == "它比 fp32 快 2.00 倍，量化层的加速里有这一份。"
    assert "并不比 fp32 快" in ch10.lin_bf16_sentence(1e-3, 0.95e-3, "fp32")
    assert "基线本身就是 bf16" in ch10.lin_bf16_sentence(2e-3, 1e-3, "bf16")


def test_the_fp8_sentence_at_the_larger_batch_follows_speed_and_bytes():
    assert ch10.fp8_big_sentence({"speedup": 1.3, "read_ratio": 1.13}, False).startswith("批大一些时 fp8 KV 快了一些")
    assert "KV 只占一步字节的一小部分" in ch10.fp8_big_sentence({"speedup": 1.0, "read_ratio": 1.13}, False)
    assert "类型转换把省下的时间用掉了" in ch10.fp8_big_sentence({"speedup": 1.0, "read_ratio": 1.6}, False)
    slower_cpu = ch10.fp8_big_sentence({"speedup": 0.72, "read_ratio": 1.13}, False)
    assert "反而更慢" in slower_cpu and "_attend" in slower_cpu
    assert "_attend" not in ch10.fp8_big_sentence({"speedup": 0.72, "read_ratio": 1.13}, True)
