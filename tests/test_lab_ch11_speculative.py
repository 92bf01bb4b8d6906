"""The speculative decoding lab's kit (minillm.lab.chapters.ch11_speculative): τ from α and γ, the
floor of a verify step beside a decode step's, where verifying turns compute-bound, the speedup
model, what published pairs imply, and the sentences chosen from measurements."""
import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402

from minillm.engine.config import load_config  # noqa: E402
from minillm.lab import estimate as L  # noqa: E402
from minillm.lab.chapters import ch11_speculative as ch11  # noqa: E402
from minillm.lab.gpus import lookup_gpu  # noqa: E402

CFG = load_config("llama-3.1-8b")
H100, RTX = lookup_gpu("H100 SXM"), lookup_gpu("RTX 3090")


def test_accepted_length_sums_the_geometric_series():
    assert ch11.accepted_length(0.0, 4) == 1.0
    assert ch11.accepted_length(1.0, 4) == 5.0
    assert ch11.accepted_length(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert ch11.accepted_length(0.8, 4) == pytest.approx(sum(0.8 ** i for i in range(5)))
    with pytest.raises(ValueError):
        ch11.accepted_length(1.2, 4)


def test_a_plain_decode_step_is_verify_with_no_proposals():
    d = L.decode_step(CFG, 4, ch11.CTX, H100.bandwidth).floor(H100.bf16_flops)
    v = ch11.verify_floor(CFG, H100, 4, 0)
    assert (v.flops, v.bytes) == (d.flops, d.bytes)
    five = ch11.verify_floor(CFG, H100, 4, 4)
    assert five.flops == 5 * d.flops and five.bytes == d.bytes  # FLOPs grow, the bytes read do not


def test_at_batch_one_verifying_costs_a_decode_step():
    assert ch11.verify_floor(CFG, H100, 1, 4).bound == "memory"
    assert ch11.verify_ratio(CFG, H100, 1, 4) == 1.0


def test_compute_bound_batch_is_where_the_verify_floor_turns():
    for gpu in (H100, RTX):
        b = ch11.compute_bound_batch(CFG, gpu, 4)
        assert ch11.verify_floor(CFG, gpu, b, 4).bound == "compute"
        assert ch11.verify_floor(CFG, gpu, b - 1, 4).bound == "memory"
        assert ch11.compute_bound_batch(CFG, gpu, 8) < b  # more proposals: compute-bound sooner
    assert 1 < ch11.verify_ratio(CFG, H100, 256, 4) < ch11.verify_ratio(CFG, H100, 1024, 4)  # past the ridge: they cost


def test_speedup_is_tau_over_the_steps_cost():
    assert ch11.speedup(0.8, 4) == ch11.accepted_length(0.8, 4)
    assert ch11.speedup(0.8, 4, 0.1) == pytest.approx(ch11.accepted_length(0.8, 4) / 1.4)
    assert ch11.speedup(0.0, 4, 0.2) < 1  # nothing accepted and drafting cost: slower
    assert ch11.implied_overhead(1.83, 2.29) == pytest.approx(2.29 / 1.83 - 1)


def test_spec_bench_rows_quote_the_published_pairs_and_their_implied_overhead():
    rows = {r[0]: r[1:] for r in ch11.spec_bench_rows()}
    x, tokens, _ = ch11.SPEC_BENCH["草稿模型"]
    assert rows["草稿模型"] == [f"{x:.2f}×", f"{tokens:.2f}", f"{tokens / x - 1:.0%}"]
    x, tokens, summary = ch11.SPEC_BENCH["提示查找（n-gram）"]
    assert rows["提示查找（n-gram）"][0] == f"{x:.2f}×（摘要 {summary:.2f}×）"
    assert list(rows) == list(ch11.SPEC_BENCH)


def tau_run(alpha, measured, drafts=10, proposed=40):
    return {"acceptance_rate": alpha, "mean_accepted_length": measured, "num_drafts": drafts,
            "num_draft_tokens": proposed}


def test_tau_sentence_follows_the_numbers():
    formula = ch11.accepted_length(0.6, 4)
    assert ch11.tau_sentence(tau_run(0.6, formula * 1.05)).startswith("实测的每次验证产出和公式")
    assert "成串" in ch11.tau_sentence(tau_run(0.6, formula * 1.5))
    assert "不足 γ 个" in ch11.tau_sentence(tau_run(0.6, formula * 0.7, proposed=30))  # 3 per verify of γ = 4
    full = ch11.tau_sentence(tau_run(0.6, formula * 0.7, proposed=38))  # 3.8 per verify: nearly full
    assert "一开头就断" in full and "不足" not in full
    assert "α = 0" in ch11.tau_sentence(tau_run(0.0, 1.0))
    assert "一次也没猜" in ch11.tau_sentence(tau_run(0.0, 1.0, drafts=0, proposed=0))


def test_batch_sentence_says_only_whether_the_speedup_shrank():
    small, big = {"speedup": 1.6}, {"speedup": 1.2}
    assert ch11.batch_sentence(small, big, 8) == "批 8 时，照抄给定段落的加速比批 1 时小。"
    assert ch11.batch_sentence(big, small, 8) == "批 8 时，照抄给定段落的加速并不比批 1 时小。"


def test_measured_rows_compare_tau_to_the_formula():
    run = {"acceptance_rate": 0.5, "tokens_per_step_on": 14.4, "tokens_per_step_off": 8.0, "num_draft_tokens": 40,
           "mean_accepted_length": 2.0, "off_s": 2.0, "on_s": 1.0, "speedup": 2.0, "identical": True}
    row, = ch11.measured_rows({("grounded", 8): run})
    assert row[:6] == ["照抄给定段落", "8", "50%", "1.80×", "2.00", f"{ch11.accepted_length(0.5, 4):.2f}"]
    assert row[8] == "2.00×" and len(row) == len(ch11.MEASURED_HEADER)
    none = dict(run, num_draft_tokens=0, acceptance_rate=0.0, mean_accepted_length=1.0, tokens_per_step_on=8.0)
    words = ch11.run_words(none)  # nothing proposed: no acceptance to show
    assert words["accept"] == words["tau"] == words["formula"] == ch11.NO_DRAFTS and words["tps"] == "1.00×"


def test_best_gamma_and_break_even():
    assert ch11.best_gamma(0.9, 0.0) == 16  # free drafts: guess as far as allowed
    k = ch11.best_gamma(0.7, 0.2)
    assert ch11.speedup(0.7, k, 0.2) >= max(ch11.speedup(0.7, j, 0.2) for j in range(1, 17))
    assert ch11.break_even_alpha(4, 1.0) == 0.0
    a = ch11.break_even_alpha(4, 2.0)
    assert ch11.accepted_length(a, 4) >= 2.0 > ch11.accepted_length(a - 0.001, 4)
    assert ch11.break_even_alpha(2, 5.0) is None  # τ <= 3 < 5


def test_open_sentence_follows_what_was_proposed_and_accepted():
    run = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "speedup": 0.8}
    assert "一次也没找到" in ch11.open_sentence(run)
    assert "并不比不开慢" in ch11.open_sentence(dict(run, num_draft_tokens=6, speedup=1.0))
    assert "比不开还慢" in ch11.open_sentence(dict(run, num_draft_tokens=6))
    assert "反而变慢" in ch11.open_sentence(dict(run, num_draft_tokens=6, num_accepted_tokens=2))


# -- the self-draft ------------------------------------------------------------------------------------
SMOL = load_config("smollm2-135m")


def draft_run(layers, accept, tau, gamma, c, v, speedup):
    return {"speculative_config": {"num_draft_layers": layers}, "acceptance_rate": accept, "mean_accepted_length": tau,
            "proposals_per_verify": gamma, "draft_cost": c, "verify_cost": v,
            "predicted_speedup": tau / (gamma * c + v), "speedup": speedup}


def test_the_bytes_ratio_of_a_draft_counts_its_layers_and_the_output_layer():
    h, vocab, n = SMOL.hidden_size, SMOL.vocab_size, SMOL.num_layers
    per_layer = (L.matmul_param_count(SMOL) - vocab * h) / n
    assert ch11.bytes_draft_cost(SMOL, 12) == pytest.approx((12 * per_layer + vocab * h) / (n * per_layer + vocab * h))
    assert ch11.bytes_draft_cost(SMOL, 12) > 12 / n  # the output layer is read by every draft pass
    assert ch11.bytes_draft_cost(SMOL, n) == 1.0


def test_draft_rows_put_the_measured_cost_beside_the_bytes_ratio():
    drafts = {12: draft_run(12, 0.05, 1.15, 3.0, 0.6, 1.5, 0.35), 27: draft_run(27, 0.45, 2.1, 3.0, 1.0, 1.6, 0.45)}
    rows = ch11.draft_rows(drafts, SMOL)
    assert rows[0] == ["12 / 30", "5%", "1.15", "3.00", "0.60", f"{ch11.bytes_draft_cost(SMOL, 12):.2f}", "1.50",
                       f"{1.15 / 3.3:.2f}×", "0.35×"]
    assert rows[1][7] == f"{2.1 / 4.6:.2f}×" and len(rows[1]) == len(ch11.DRAFT_HEADER)
    assert ch11.draft_sentence(drafts).startswith("两种深度都让解码变慢了：浅的草稿便宜得多")  # 1.0 >= 1.3 x 0.6
    assert "并不比它便宜多少" in ch11.draft_sentence({12: {**drafts[12], "draft_cost": 0.9}, 27: drafts[27]})
    assert "并没有" in ch11.draft_sentence({12: drafts[27], 27: drafts[12]})
    bytes_12 = ch11.bytes_draft_cost(SMOL, 12)
    assert ch11.cost_sentence(drafts, SMOL).startswith("浅的草稿实测的 c 和它的字节之比相差不大")  # 0.6 < 1.3 x 0.53
    assert "远高于" in ch11.cost_sentence({12: {**drafts[12], "draft_cost": 1.3 * bytes_12}}, SMOL)
    assert ch11.draft_sentence({12: drafts[12], 27: {**drafts[27], "speedup": 1.2}}).startswith("至少有一种")
    assert "不到 15%" in ch11.predict_sentence(drafts)  # 0.348 vs 0.35, 0.457 vs 0.45
    assert "15% 以上" in ch11.predict_sentence({12: {**drafts[12], "speedup": 0.5}})


def test_exercise_4_breaks_even_where_tau_pays_for_the_step():
    alpha = ch11.break_even_alpha(3, 1.2, 0.3)
    assert ch11.speedup(alpha, 3, 0.3, 1.2) >= 1 > ch11.speedup(alpha - 0.001, 3, 0.3, 1.2)
    assert ch11.break_even_sentence(alpha, "这一步") == f"接受率至少要 {alpha:.0%}，这一步才不比普通解码慢。"
    assert ch11.break_even_alpha(3, 1.6, 1.0) is None  # γ + 1 = 4 < 3 × 1.0 + 1.6
    assert ch11.break_even_sentence(None, "验证这一步") == \
        "没有这样的接受率：即使每个猜测都被收下，τ = γ + 1 也抵不过验证这一步的花费。"
