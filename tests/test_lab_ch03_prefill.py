"""The kit of chapter 3 (预填充): the page's ledger of Llama-3.1-8B on the spec cards, the chunked
prefill floors, and the lab's sweep arithmetic (the output layer billed once, the linear layers'
bytes without the input embedding)."""
import pytest
import torch

from minillm.engine.config import load_config
from minillm.engine.loader import load_model
from minillm.lab import estimate as L
from minillm.lab.chapters import ch03_prefill as kit
from minillm.lab.gpus import lookup_gpu


@pytest.fixture(scope="module")
def numbers():
    return kit.page_numbers()


def test_the_question_short_is_bandwidth_bound_long_is_compute_bound(numbers):
    assert numbers["short_floor"] == "≥ 4.79 ms（带宽：M/W）"
    assert numbers["long_floor"] == "≥ 133.34 ms（算力：F/P）"
    assert numbers["q_ratio"] == "28"
    assert (numbers["n1_read"], numbers["n1_compute"]) == ("4.79 ms", "15 µs")


def test_the_engine_bills_the_output_layer_once(numbers):
    assert (numbers["rule_int_512"], numbers["rule_int_2048"]) == ("478", "1,914")  # the rule of thumb
    assert (numbers["int_512"], numbers["int_2048"]) == ("447", "1,818")  # as the engine computes
    assert (numbers["layer_gflop"], numbers["lm_head_gflop"], numbers["matmul_gflop"]) == ("13.96", "1.05", "15.01")
    cfg = load_config("llama-3.1-8b")
    assert kit.linear_flops(cfg, 100) == L.prefill(cfg, 100).linear_flops


def test_crossover_on_the_h100_and_the_cards(numbers):
    assert numbers["cross"] == "339" and numbers["card_ridge"] == "295"
    assert numbers["cross_low"] == "88（RTX 3090）" and numbers["cross_high"] == "480（L40S）"
    cfg, h100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")
    assert kit.card_floor(cfg, 339, h100).bound == "compute" and kit.card_floor(cfg, 338, h100).bound == "memory"
    assert all(row[3].endswith("（算力：F/P）") for row in kit.card_rows())


def test_attention_share_grows_with_the_prompt(numbers):
    assert [numbers[f"attn_share_{n}"] for n in (8192, 32768, 131072)] == ["13%", "38%", "71%"]


def test_exercises(numbers):
    assert numbers["ex1_ratio"] == numbers["ex1_flops_ratio"] == "6.0"
    assert (numbers["ex2_llama-3.1-8b"], numbers["ex2_llama-3.1-8b_fp8"]) == ("339", "170")
    assert numbers["ex3_64"].startswith("634.3 ms（4.76 倍")
    assert numbers["ex3_8192"] == "133.3 ms（1.00 倍，1 块）"


def test_one_chunk_is_the_whole_prefill():
    cfg, h100 = load_config("llama-3.1-8b"), lookup_gpu("H100 SXM")
    for n in (1, 100, 8192):
        assert kit.chunked_floor(cfg, n, n, h100) == pytest.approx(kit.card_floor(cfg, n, h100).seconds)
    with pytest.raises(ValueError):
        kit.chunked_floor(cfg, 8192, 0, h100)


def test_linear_bytes_leave_out_the_input_embedding():
    llama, smol = load_config("llama-3.1-8b"), load_config("smollm2-135m")
    assert kit.linear_bytes(llama, "bf16") == L.weight_bytes(llama) - 2 * (llama.vocab_size * llama.hidden_size
                                                                           + L.param_breakdown(llama)["norms"])
    # tied: the output layer reads the table, so every weight but the norms is read
    assert smol.tie_word_embeddings
    assert kit.linear_bytes(smol, "fp32") == L.weight_bytes(smol, "fp32") - 4 * L.param_breakdown(smol)["norms"]


def test_sweep_arithmetic():
    cfg = load_config("smollm2-135m")
    s = kit.Sweep(cfg, "float32", 1e11, 4e10, forward={1: 0.05, 256: 0.8}, linear={1: 0.04, 256: 0.7})
    assert s.knee == pytest.approx(0.05 / (0.8 / 256))
    assert s.mfu(256) == pytest.approx(L.prefill(cfg, 256, "fp32").flops / 0.8 / 1e11)
    assert s.read_rate(1) == pytest.approx(kit.linear_bytes(cfg, "fp32") / 0.04)
    assert s.floor(1).bound == "memory" and s.floor(256).bound == "compute"
    assert s.crossover == L.prefill_crossover(cfg, 1e11, 4e10, "fp32")
    assert kit._beat_why(s, 1) is None and kit._beat_why(s, 256) is None  # both above their floors
    fast = kit.Sweep(cfg, "float32", 1e11, 4e10, forward={256: 0.01}, linear={256: 0.005})
    assert kit._beat_why(fast, 256) == (f"n = 256 时，模型自己的线性层跑出 {fast.shape_rate(256) / 1e9:,.1f} GFLOP/s，"
                                        "高于方阵探测的 100.0 GFLOP/s")


def test_sweep_times_a_real_model():
    torch.set_num_threads(1)
    model = load_model("tiny", device="cpu", dtype=torch.float32, weights="random")
    s = kit.sweep(model, (1, 8), 1e11, 4e10, repeats=2, rounds=2)
    assert s.lengths == [1, 8] and s.repeats == 2
    assert all(t > 0 for t in (*s.forward.values(), *s.linear.values()))
    with pytest.raises(ValueError, match="rounds"):
        kit.sweep(model, (1,), 1e11, 4e10, repeats=1, rounds=2)
    seconds = kit.logits_seconds(model, 8, repeats=1)
    assert set(seconds) == {False, True} and min(seconds.values()) > 0
