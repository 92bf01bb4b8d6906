"""Chapter 量化: the ledger of fewer bytes per number, and what book/ch10-quantization.md says of it.

Each test names the page's statement it guards; the page computes the same numbers with the same
ledger functions (``minillm.lab.estimate``, ``minillm.engine.planner.plan``)."""
import pytest
import torch

from minillm.engine.config import load_config, resolve_checkpoint
from minillm.engine.gguf_file import GGUFFile
from minillm.engine.planner import plan
from minillm.engine.quantization import check_shapes
from minillm.lab import estimate as L
from minillm.lab.gpus import lookup_gpu

CFG, SMALL = load_config("llama-3.1-8b"), load_config("smollm2-135m")
H100, RTX, A10 = lookup_gpu("H100 SXM"), lookup_gpu("RTX 4090"), lookup_gpu("A10")
BF16, INT8, INT4, FP8, INT4_FP8 = (None, "bf16"), ("int8", "bf16"), ("int4", "bf16"), (None, "fp8"), ("int4", "fp8")
GRID = [(q, kv) for q in (None, "int8", "int4") for kv in ("bf16", "fp8")]


def step(spec, fmt, batch, ctx=4096):
    return L.decode_step(CFG, batch, ctx, spec.bandwidth, "bf16", fmt[0], 32, fmt[1])


def floor(spec, fmt, batch, ctx=4096):
    return step(spec, fmt, batch, ctx).floor(spec.bf16_flops)


def crossing(spec, fmt, ctx):
    return L.compute_bound_batch(lambda b: step(spec, fmt, b, ctx), spec.bf16_flops)


def dry_run(fmt, group_size=32):
    return plan(CFG, gpu_memory="24GiB", quantization=fmt[0], group_size=group_size,
                kv_cache_dtype="fp8" if fmt[1] == "fp8" else "auto", max_model_len=-1)


def per_weight(quantization, group_size=32, k=4096):
    return L.quantized_linear_bytes(1, k, quantization, group_size) / k


def test_bytes_per_weight_count_the_group_parameters():
    """The bytes-per-weight table: int4 in groups of 32 spends a fifth on its scales and minimums."""
    assert per_weight("int8") == 1 + 4 / 4096
    assert per_weight("int4", 32) == 0.625 and 1 - 0.5 / per_weight("int4", 32) == pytest.approx(0.2)
    assert per_weight("int4", 128) == 0.5 + 4 / 128


def test_smollm2s_layers_are_q4_1_and_its_embedding_table_q8_0():
    """'每一层的矩阵本来就存成 4 位的 Q4_1 ……（只有词嵌入表存成 8 位的 Q8_0）'."""
    tensors = GGUFFile(resolve_checkpoint("smollm2-135m")).tensors
    matrices = {name: t.type_name for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2}
    assert len(matrices) == 7 * SMALL.num_layers and set(matrices.values()) == {"Q4_1"}
    assert tensors["token_embd.weight"].type_name == "Q8_0" and "output.weight" not in tensors  # tied


def test_the_bytes_ratios_stay_below_the_bytes_per_weight():
    """'字节之比却到不了 4 倍、8 倍' (SmolLM2 in fp32, the weights a decode step reads)."""
    read = {q: L.decode_read_bytes(SMALL, "fp32", q) for q in (None, "int8", "int4")}
    assert 3.9 < read[None] / read["int8"] < 4 and 5 < read[None] / read["int4"] < 8


def test_decode_reads_no_embedding_table_unless_it_is_the_output_layer():
    table = L.param_breakdown(SMALL)["embedding"] * 4
    assert SMALL.tie_word_embeddings and not CFG.tie_word_embeddings
    assert L.decode_read_bytes(SMALL, "fp32") == L.weight_bytes(SMALL, "fp32")  # tied: the table is the output layer
    assert L.decode_read_bytes(SMALL, "fp32", "int4") == L.weight_bytes(SMALL, "fp32", "int4") - table
    assert L.decode_read_bytes(CFG) == L.weight_bytes(CFG) - L.param_breakdown(CFG)["embedding"] * 2
    # the page's SmolLM2 table: the bytes decode reads shrink far more than all the weights do
    assert L.weight_bytes(SMALL, "fp32") / L.weight_bytes(SMALL, "fp32", "int4") < 3
    assert L.decode_read_bytes(SMALL, "fp32") / L.decode_read_bytes(SMALL, "fp32", "int4") > 5


def test_batch_1_decode_is_bandwidth_bound_in_every_format_on_every_card():
    """'五种格式的下界都由带宽卡住' (H100) and '批 1 时每张卡都被带宽卡住' (the card table)."""
    for name in ("L4", "A10", "RTX 4090", "A100 80GB SXM", "H100 SXM", "H200"):
        spec = lookup_gpu(name)
        assert all(floor(spec, fmt, 1).bound == "memory" for fmt in (BF16, INT8, INT4, FP8, INT4_FP8))
    assert max(floor(H100, fmt, 1).intensity for fmt in GRID) < 3 < H100.ridge_point
    assert round(floor(H100, BF16, 1).seconds / floor(H100, INT4, 1).seconds, 2) == 2.56


@pytest.mark.parametrize("fmt", [BF16, INT8, INT4, INT4_FP8])
def test_compute_bound_batch_is_where_the_floor_turns(fmt):
    batch = crossing(H100, fmt, 128)
    assert floor(H100, fmt, batch, 128).bound == "compute" and floor(H100, fmt, batch - 1, 128).bound == "memory"


def test_fewer_bytes_cross_the_ridge_sooner_and_long_contexts_never():
    """'越过脊点需要的批就越小'; at 4,096 tokens '任何批都不会'; the KV's intensity limit stays low."""
    for spec in (H100, RTX):
        batches = [crossing(spec, fmt, 128) for fmt in (BF16, INT8, INT4, INT4_FP8)]
        assert batches == sorted(batches, reverse=True) and batches[0] > 2.5 * batches[2]
        assert all(crossing(spec, fmt, 4096) is None for fmt in GRID)
    limit = {kv: (L.matmul_flops_per_token(CFG) + L.attention_flops_per_token(CFG, 4096)) / L.kv_bytes(CFG, 4096, kv)
             for kv in ("bf16", "fp8")}
    assert 30 < limit["bf16"] < 35 and limit["fp8"] == 2 * limit["bf16"] < RTX.ridge_point < H100.ridge_point


def test_the_24gib_dry_run():
    """fp8 KV doubles the blocks; int4 weights free more room than fp8 KV; the pools past 131,072
    tokens cap max_model_len; together 5.2 times bf16's tokens."""
    dry = {fmt: dry_run(fmt) for fmt in GRID}
    assert dry[FP8].num_blocks - 2 * dry[BF16].num_blocks in (0, 1)  # doubled, but for the block the rounding adds
    assert dry[INT4].tokens > dry[FP8].tokens > dry[BF16].tokens
    assert dry[INT4].weight_bytes == L.weight_bytes(CFG, "bf16", "int4")
    assert 9.5e9 < dry[BF16].weight_bytes - dry[INT4].weight_bytes < 10.5e9
    capped = [fmt for fmt, p in dry.items() if p.tokens > CFG.max_position_embeddings]
    assert capped == [("int8", "fp8"), INT4_FP8]
    assert all(dry[fmt].max_model_len == CFG.max_position_embeddings for fmt in capped)
    assert round(dry[INT4_FP8].tokens / dry[BF16].tokens, 1) == 5.2
    # the figure: each switch to fp8 KV doubles the bar (to a block); bf16 weights take most of the card
    for q in (None, "int8", "int4"):
        assert abs(dry[q, "fp8"].num_blocks - 2 * dry[q, "bf16"].num_blocks) <= 1
    assert dry[BF16].weight_bytes > dry[BF16].budget_bytes / 2


def test_the_output_layer_s_share_of_an_int4_step():
    """'输出层在它 int4 模型一步读的字节里占三成；Llama-3.1-8B 的 int4 模型里只占一成左右'."""
    small = L.quantized_linear_bytes(SMALL.vocab_size, SMALL.hidden_size, "int8") / L.decode_read_bytes(SMALL, "fp32", "int4")
    big = L.quantized_linear_bytes(CFG.vocab_size, CFG.hidden_size, "int8") / L.decode_read_bytes(CFG, "bf16", "int4")
    assert round(small, 1) == 0.3 and round(big, 1) == 0.1
    assert (SMALL.vocab_size, SMALL.hidden_size) == (49152, 576)


def test_e4m3_rounds_within_a_sixteenth_and_saturates_at_448():
    e4m3 = torch.finfo(torch.float8_e4m3fn)
    assert e4m3.max == 448 and e4m3.eps / 2 == 0.0625 and e4m3.smallest_normal == 2 ** -6


def test_gpt_fast_published_bytes_per_token_match_the_ledger():
    """'每 token 读的字节和账本相差不到 2%'; the effective bandwidth falls format by format; the
    speedups stay below the bytes ratios (gpt-fast's README, Llama-2-7B, batch 1)."""
    published = {None: (104.9, 1397.31), "int8": (155.58, 1069.20), "int4": (196.80, 862.69)}  # tok/s, GB/s
    llama2 = load_config("llama-2-7b")
    for q, (tok_s, gb_s) in published.items():
        assert abs(gb_s / tok_s * 1e9 / L.weight_bytes(llama2, "bf16", q) - 1) < 0.02
        if q is not None:
            assert tok_s / published[None][0] < L.weight_bytes(llama2) / L.weight_bytes(llama2, "bf16", q)
    assert published[None][1] > published["int8"][1] > published["int4"][1]


def test_marlin_s_batches_stay_below_the_int4_crossing_on_an_a10():
    """'fp16 的权重要批 …… 才越过脊点，int4 的权重批 …… 就越过了；批 16 到 32 仍在它之下'."""
    cross = {q: A10.ridge_point * (per_weight(q, 128) if q else 2) / 2 for q in (None, "int4")}
    assert 32 < cross["int4"] < cross[None] and round(2 / per_weight("int4", 128), 2) == 3.76


def test_serving_at_an_slo_on_the_rtx_4090():
    """At 50 ms every format is memory-limited (the batch is the plan's concurrency); at 15 ms the
    bf16 weights alone take too long to read, and int4 with fp8 KV still serves a batch."""
    def at_slo(fmt, slo):
        batch = dry_run(fmt).concurrent_requests(4096)
        while batch and floor(RTX, fmt, batch).seconds > slo:
            batch -= 1
        return batch

    assert all(at_slo(fmt, 0.050) == dry_run(fmt).concurrent_requests(4096) for fmt in GRID)
    assert at_slo(BF16, 0.015) == 0 and L.weight_bytes(CFG) / RTX.bandwidth > 0.015
    assert at_slo(INT4_FP8, 0.015) > 10
    # at 50 ms both full batches read about the whole budget: the steps take as long, the cost is the batch
    full = {fmt: floor(RTX, fmt, at_slo(fmt, 0.050)) for fmt in (BF16, INT4_FP8)}
    assert abs(full[BF16].seconds / full[INT4_FP8].seconds - 1) < 0.03  # '几乎一样长'
    assert all(0.9 * dry_run(fmt).budget_bytes < f.bytes < dry_run(fmt).budget_bytes for fmt, f in full.items())


def test_cost_per_million_tokens():
    assert L.cost_per_million(1000, 3.6) == pytest.approx(1.0)  # 3.6 M tokens an hour for 3.6 $
    with pytest.raises(ValueError):
        L.cost_per_million(0, 2.0)


def test_the_exercises():
    """1: groups of 128 fit more tokens, and SmolLM2's 576 is no multiple of 128; 2: at 32K and B = 8
    fp8 KV lowers the floor more than int4 weights."""
    assert dry_run(INT4, 128).tokens > dry_run(INT4).tokens
    with pytest.raises(ValueError, match="576"):
        check_shapes(SMALL, "int4", 128)
    assert floor(H100, FP8, 8, 32768).seconds < floor(H100, INT4, 8, 32768).seconds
    assert all(L.kv_bytes(CFG, 8 * 32768, kv) > floor(H100, (q, kv), 8, 32768).bytes / 2 for q, kv in GRID)  # 大半是 KV
