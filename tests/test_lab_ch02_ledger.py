"""The kit of chapter 2 (为什么服务大模型难): the page's ledger reproduces every figure of the
chapter, the one floor names the ceiling that binds, and the lab's helpers say which side of the
ridge a step is on."""
import pytest

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.chapters import ch02_ledger as kit
from minillm.lab.gpus import gpu_specs, lookup_gpu


@pytest.fixture(scope="module")
def numbers():
    return kit.page_numbers()


def test_weights_and_flops(numbers):
    assert numbers["params"] == "8,030,261,248"
    assert (numbers["w_gb"], numbers["w_gib"]) == ("16.06 GB", "14.96 GiB")
    assert (numbers["matmul_params_b"], numbers["matmul_gflop"]) == ("7.505", "15.01")
    assert [numbers[f"attn_gflop_{c}"] for c in (1024, 4096, 8192)] == ["0.537", "2.147", "4.295"]


def test_long_context_attention_overtakes_the_linear_layers(numbers):
    cfg = load_config("llama-3.1-8b")
    assert numbers["attn_share_8192"] == "22.2%" and numbers["attn_share_32768"] == "53.4%"
    cross = kit.attention_crossover(cfg)
    assert L.attention_flops_per_token(cfg, round(cross)) == pytest.approx(L.matmul_flops_per_token(cfg), rel=1e-4)
    assert 28_000 < cross < 29_000


def test_prefill_intensity_the_rule_of_thumb_and_the_engines_count(numbers):
    assert (numbers["prefill_int_512"], numbers["prefill_int_2048"]) == ("478", "1,914")
    assert (numbers["prefill_tflop_512"], numbers["prefill_tflop_2048"]) == ("7.68", "30.74")
    cfg = load_config("llama-3.1-8b")
    for n in (512, 2048):
        engine = L.prefill(cfg, n).intensity
        assert engine < kit.rule_of_thumb_intensity(cfg, n)  # the output layer once, not n times
        assert engine > max(s.ridge_point for s in gpu_specs())  # compute-bound on every card
    assert (numbers["engine_int_512"], numbers["engine_int_2048"]) == ("447", "1,818")
    n = int(numbers["cross_all"].replace(",", ""))  # from this length on, compute-bound on every card
    assert all(L.prefill(cfg, n).floor(s.bf16_flops, s.bandwidth).bound == "compute" for s in gpu_specs())
    assert any(L.prefill(cfg, n - 1).floor(s.bf16_flops, s.bandwidth).bound == "memory" for s in gpu_specs())


def test_decode_on_the_made_up_card_is_bandwidth_bound_with_the_seed_figures(numbers):
    peak, bandwidth = kit.hypothetical_card()
    assert bandwidth == 1e12 and peak / bandwidth == pytest.approx(min(s.ridge_point for s in gpu_specs()))
    assert [numbers[f"dec_gb_{b}"] for b in (1, 16, 48)] == ["16.19 GB", "18.21 GB", "22.50 GB"]
    assert [numbers[f"dec_ms_{b}"] for b in (1, 16, 48)] == ["16.19 ms", "18.21 ms", "22.50 ms"]
    assert [numbers[f"dec_tok_{b}"] for b in (1, 16, 48)] == ["62", "879", "2,133"]
    assert [numbers[f"dec_int_{b}"] for b in (1, 16, 48)] == ["1.0", "13.7", "33.2"]
    assert all(f.bound == "memory" for _, f in kit.decode_floors(load_config("llama-3.1-8b")).values())
    assert numbers["kv_intensity"] == "4"
    assert [row[4] for row in kit.decode_rows()][0] == "≥ 16.19 ms（带宽：M/W）"


def test_kv_and_the_24_gib_card(numbers):
    assert (numbers["kv_per_token"], numbers["kv_per_token_kib"], numbers["kv_per_token_mha_kib"]) == (
        "131,072", "128 KiB", "512 KiB")
    assert [numbers[f"kv_req_{c}"] for c in kit.CONTEXTS] == ["0.125 GiB", "0.500 GiB", "1.000 GiB", "16.000 GiB"]
    assert (numbers["usable_gib"], numbers["left_gib"], numbers["tokens_fit"]) == ("22.08 GiB", "7.12 GiB", "58,347")
    assert [numbers[f"conc_{c}"] for c in (1024, 4096, 8192)] == ["57.0", "14.2", "7.1"]
    assert (numbers["mha_kv_tokens"], numbers["mha_intensity"]) == ("14,587", "1.0")
    assert numbers["waste"] == "87.5%"
    assert int(numbers["fit_prealloc"]) < int(numbers["fit_actual"])


def test_exercises(numbers):
    assert numbers["ex2_tokens"] == "480,399"
    assert numbers["ex2_floor"].endswith("（带宽：M/W）")
    assert float(numbers["ex3_qwen_8k"]) > 2 * float(numbers["ex3_llama_8k"])


def test_decode_crossover_is_the_first_compute_bound_batch():
    cfg = load_config("smollm2-135m")
    peak, bandwidth = 87.5e9, 26.1e9  # a one-thread CPU: a ridge of about 3.4
    b = kit.decode_crossover(cfg, 128, "float32", peak, bandwidth)
    assert b is not None and 4 < b < 16
    assert L.decode_step(cfg, b, 128, bandwidth, "float32").floor(peak).bound == "compute"
    assert L.decode_step(cfg, b - 1, 128, bandwidth, "float32").floor(peak).bound == "memory"
    h100 = lookup_gpu("H100 SXM")  # the 8B's own KV keeps every batch below this ridge at ctx 1024
    assert kit.decode_crossover(load_config("llama-3.1-8b"), 1024, "bf16", h100.bf16_flops, h100.bandwidth) is None


def test_sides_name_the_binding_ceiling():
    cfg = load_config("smollm2-135m")
    rows = dict(kit.sides(cfg, "float32", 87.5e9, 26.1e9, 128))
    assert rows["预填充 n = 1"].bound == "memory" and rows["预填充 n = 1,024"].bound == "compute"
    assert rows["解码一步 B = 1（上下文 128）"].bound == "memory"
    assert rows["解码一步 B = 64（上下文 128）"].bound == "compute"


def test_the_calculator_answers_in_chinese(capsys):
    kit.calculator("llama-3.1-8b", "RTX 4090", 0.92, 8192)
    out = capsys.readouterr().out
    assert out.startswith("KV 可放 58,347 个 token") and "7.1 个请求" in out and "带宽" in out
    kit.calculator("llama-3.1-8b", "L4", 0.5, 8192)
    assert "放不进" in capsys.readouterr().out


def test_param_check_fails_on_a_wrong_count():
    kit.show_param_check({"tiny": L.param_count(load_config("tiny"))})
    with pytest.raises(AssertionError, match="tiny"):
        kit.show_param_check({"tiny": L.param_count(load_config("tiny")) + 1})


def test_real_cards_report_less_than_24_gib(numbers):
    rows = kit.real_card_rows()
    assert rows[0][0] == "账本：24 GiB" and rows[0][3] == "58,347"
    assert all(int(r[3].replace(",", "")) < 58_347 for r in rows[1:])
    assert numbers["rtx4090_tokens"] == rows[1][3]


def test_the_crossover_sentence_follows_the_batch():
    crossed = kit.cross_words("smollm2-135m", "float32", 9)
    assert crossed.startswith("在这台机器上，“解码受带宽限制”并不总成立") and "从 B = 9 起就落到算力一侧" in crossed
    never = kit.cross_words("llama-3.1-8b", "bf16", None)
    assert never.startswith("在这台机器上，“解码受带宽限制”一直成立") and "None" not in never
    assert crossed.endswith("。") and never.endswith("。")


@pytest.mark.parametrize("ridge, band", [(3.4, "还低一个数量级以上"), (60.0, "还低："), (150.0, "这不低于")])
def test_the_ridge_sentence_picks_its_band(ridge, band):
    words = kit.ridge_words(ridge, 100.0)
    assert band in words and "（100）" in words and words.endswith("。")
    assert sum(b in words for b in ("还低一个数量级以上", "还低：", "这不低于")) == 1
