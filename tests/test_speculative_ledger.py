"""Chapter 投机解码: the ledger of a verify step and of the accepted length, and what
book/ch11-speculative.md says of them. Each test names the page's statement it guards."""
import pytest

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.gpus import lookup_gpu

CFG = load_config("llama-3.1-8b")
H100, RTX = lookup_gpu("H100 SXM"), lookup_gpu("RTX 3090")


def verify(gpu, batch, gamma, ctx=1024):
    return L.verify_step(CFG, batch, ctx, gpu.bandwidth, gamma).floor(gpu.bf16_flops)


def ratio(gpu, batch, gamma):
    return verify(gpu, batch, gamma).seconds / verify(gpu, batch, 0).seconds


def crossing(gpu, gamma):
    return L.compute_bound_batch(lambda b: L.verify_step(CFG, b, 1024, gpu.bandwidth, gamma), gpu.bf16_flops)


def test_a_verify_step_is_a_decode_step_with_more_flops_and_the_same_bytes():
    plain = L.decode_step(CFG, 4, 1024, H100.bandwidth)
    assert L.verify_step(CFG, 4, 1024, H100.bandwidth, 0) == plain
    five = L.verify_step(CFG, 4, 1024, H100.bandwidth, 4)
    assert five.flops == 5 * plain.flops and five.bytes == plain.bytes
    with pytest.raises(ValueError):
        L.verify_step(CFG, 4, 1024, H100.bandwidth, -1)


def test_at_batch_1_verifying_costs_a_decode_step():
    """'两步都由带宽决定'; '多验证的 4 个位置，在下界上一分钱不花'."""
    for gpu in (RTX, H100):
        assert verify(gpu, 1, 0).bound == verify(gpu, 1, 4).bound == "memory"
        assert ratio(gpu, 1, 4) == 1.0 and verify(gpu, 1, 4).intensity < 5 < gpu.ridge_point


def test_compute_bound_batch_is_where_the_verify_floor_turns():
    for gpu in (H100, RTX):
        b = crossing(gpu, 4)
        assert verify(gpu, b, 4).bound == "compute" and verify(gpu, b - 1, 4).bound == "memory"
        assert crossing(gpu, 8) < b < crossing(gpu, 2)  # more proposals: compute-bound sooner


def test_plain_decode_never_crosses_on_the_h100_and_verifying_costs_at_large_batches():
    """'普通解码在 H100 上批再大也到不了算力墙'; RTX 3090 at batch 32 and H100 at batch 512 are past
    the verify step's crossing; the RTX 3090's lines reach γ + 1 at batch 256 (the figure's alt text)."""
    assert crossing(H100, 0) is None and crossing(RTX, 0) is not None
    assert crossing(RTX, 4) <= 32 and crossing(H100, 4) <= 512
    assert round(ratio(RTX, 32, 4), 2) == 1.61 and round(ratio(H100, 512, 4), 2) == 1.59
    assert all(ratio(RTX, 256, g) == pytest.approx(g + 1) for g in (2, 4, 8))


def test_the_verify_figure():
    """The alt text: flat at 1 for small batches; the lines rise sooner with a larger γ and on the
    RTX 3090's lower ridge; the H100's stay far from γ + 1 at batch 512."""
    assert all(ratio(gpu, b, g) == 1 for gpu in (RTX, H100) for b in (1, 2, 4, 8) for g in (2, 4, 8))
    assert all(crossing(RTX, g) < crossing(H100, g) for g in (2, 4, 8)) and RTX.ridge_point < H100.ridge_point
    assert all(ratio(H100, 512, g) < (g + 1) / 2 for g in (2, 4, 8))


def test_accepted_length_sums_the_geometric_series():
    assert L.accepted_length(0.0, 4) == 1.0 and L.accepted_length(1.0, 4) == 5.0
    assert L.accepted_length(0.8, 4) == pytest.approx(sum(0.8 ** i for i in range(5)))
    assert all(L.accepted_length(a, 64) < 1 / (1 - a) for a in (0.6, 0.8, 0.9))
    with pytest.raises(ValueError):
        L.accepted_length(1.2, 4)


def test_the_acceptance_rate_in_the_formula_undercounts_tau():
    """'每次验证都猜满 γ 个时，实测的 τ 恰好是 1 + γr，而公式给出的 1 + r + … + r^γ …… 都不比它大':
    with γ proposals a verify, 1 + accepted / verifies = 1 + γ · (accepted / proposed)."""
    for gamma in (2, 4, 8):
        assert all(L.accepted_length(i / 100, gamma) <= 1 + gamma * i / 100 for i in range(101))
        assert L.accepted_length(0.5, gamma) < 1 + gamma * 0.5


def test_the_model_figure():
    """The alt text: a draft at 20% of a step is slower than no speculation at α = 0, more so the
    longer its guesses; at high α the longer guesses win; τ tends to γ + 1."""
    at = {g: [L.speculative_speedup(a, g, 0.2) for a in (0.0, 0.9, 0.98)] for g in (2, 4, 8)}
    assert 1 > at[2][0] > at[4][0] > at[8][0]
    assert all(at[2][k] < at[4][k] < at[8][k] for k in (1, 2))
    assert all(L.accepted_length(0.999, g) == pytest.approx(g + 1, abs=0.05) for g in (2, 4, 8))


def test_speedup_is_tau_over_the_steps_cost():
    assert L.speculative_speedup(0.8, 4) == L.accepted_length(0.8, 4)
    assert L.speculative_speedup(0.8, 4, 0.1) == pytest.approx(L.accepted_length(0.8, 4) / 1.4)
    assert L.speculative_speedup(0.0, 4, 0.2) < 1  # nothing accepted and drafting costs: slower


def test_a_costly_draft_wants_a_shorter_guess():
    """'草稿不免费时……最好的 γ 就变短了'; the exercise: a cheaper draft guesses further."""
    def best(alpha, c):
        return max(range(1, 17), key=lambda k: L.speculative_speedup(alpha, k, c))

    assert best(0.8, 0.0) == 16 and best(0.8, 0.2) < 16
    assert best(0.9, 0.05) > best(0.9, 0.2)


def test_a_small_draft_s_layers_are_short():
    """Qwen2.5-0.5B drafting for Qwen2.5-7B on an RTX 3090: about the bytes ratio, tens of µs a layer."""
    target, draft = load_config("qwen2.5-7b"), load_config("qwen2.5-0.5b")
    t, d = (L.decode_step(m, 1, 1024, RTX.bandwidth).floor(RTX.bf16_flops) for m in (target, draft))
    assert 0.05 < d.seconds / t.seconds < 0.1 and d.seconds / draft.num_layers < 100e-6


def test_spec_bench_s_published_pairs():
    """'提示查找多花的最少，草稿模型其次，EAGLE-2 最多'; prompt lookup gains least overall and on
    summarization more than any method overall (Spec-Bench's leaderboard, RTX 3090, Vicuna-7B)."""
    published = {"EAGLE-2": (2.19, 4.35), "draft": (1.79, 2.28), "ngram": (1.64, 1.73)}
    overhead = {m: tokens / x - 1 for m, (x, tokens) in published.items()}
    assert overhead["ngram"] < overhead["draft"] < overhead["EAGLE-2"]
    assert published["ngram"][0] == min(x for x, _ in published.values()) and 2.46 > max(x for x, _ in published.values())
