"""SamplingParams validation and sample() (chapter 解码)."""
import pytest
import torch

from minillm.engine.sampling import (TOP_P_CANDIDATES, SamplingParams, make_generator, mask_early_stops,
                                     probabilities, sample)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "1"), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5),
    ("max_tokens", 0), ("max_tokens", 3.0), ("max_tokens", True), ("seed", 1.5),
    ("stop_token_ids", (1, -2)), ("stop_token_ids", ("a",)), ("ignore_eos", 1),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 2.0),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_and_normalized_stop_ids():
    params = SamplingParams(stop_token_ids=[5, 7])
    assert params.stop_token_ids == (5, 7)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)
    assert SamplingParams(temperature=0).greedy and not params.greedy


def test_stop_tokens_are_masked_until_min_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]] * 3)
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,)),  # 1 output: masked
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,)),  # 2 outputs: free
              SamplingParams(temperature=0, min_tokens=4, ignore_eos=True, stop_token_ids=(9,))]
    logits = mask_early_stops(logits, params, [1, 2, 0], eos_token_ids=(1,))
    assert sample(logits, params, [None] * 3).tolist() == [3, 1, 1]  # EOS 1 and stop 2 masked in row 0
    assert logits[0, 1] == logits[0, 2] == -torch.inf and logits[2, 1] == 5.0


def _draws(logits, params, n, seed=0):
    generator = make_generator(seed, "cpu")
    return torch.stack([sample(logits, [params], [generator]) for _ in range(n)])[:, 0]


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits, [SamplingParams(temperature=0)] * 5, [None] * 5)
    assert torch.equal(tokens, logits.argmax(-1))


def test_frequencies_follow_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = _draws(probs.log()[None], SamplingParams(), 4000)
    freq = torch.bincount(draws, minlength=4) / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert set(_draws(logits, SamplingParams(top_k=2), 400).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(top_k=1, temperature=5.0), 50).tolist()) == {0}
    # top_p keeps the best tokens until their mass reaches top_p: 0.5 + 0.3 >= 0.7
    assert set(_draws(logits, SamplingParams(top_p=0.7), 400).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(top_p=0.5), 50).tolist()) == {0}
    assert set(_draws(logits, SamplingParams(top_p=0.81), 400).tolist()) == {0, 1, 2}


def _sorted_cut(logits, top_p, top_k=0):
    """The distribution top-k then top-p keep, computed by sorting the whole vocabulary."""
    probs, order = logits.softmax(dim=-1).sort(descending=True)
    keep = ((probs.cumsum(0) - probs) < top_p) & (torch.arange(len(probs)) < (top_k or len(probs)))
    keep[0] = True
    return torch.zeros_like(probs).scatter_(0, order, probs * keep / (probs * keep).sum())


@pytest.mark.parametrize("spread", [3.0, 0.1], ids=["peaked", "flat"])
def test_cuts_among_the_best_tokens_match_a_full_sort(spread):
    """A vocabulary past TOP_P_CANDIDATES: top-p is looked for among the best tokens (peaked: they
    hold the mass), or the whole vocabulary is sorted (flat: they do not); top-k takes its best."""
    logits = torch.randn(4 * TOP_P_CANDIDATES, generator=torch.Generator().manual_seed(0)) * spread
    for params, expected in ((SamplingParams(top_p=0.9), _sorted_cut(logits, 0.9)),
                             (SamplingParams(top_k=7, top_p=0.95), _sorted_cut(logits, 0.95, top_k=7)),
                             (SamplingParams(), logits.softmax(dim=-1))):
        torch.testing.assert_close(probabilities(logits[None], [params])[0], expected)
        drawn = _draws(logits[None], params, 20)
        assert bool((expected[drawn] > 0).all())  # every draw is a kept token


def test_the_decode_chapters_toy_distribution():
    """Chapter 解码's six-token toy: greedy draws token 0 only, top-k 2 the first two, and top-p 0.8
    the first three, because the first two hold less than 0.8 and the first three more."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    cumulative = logits.softmax(-1)[0].cumsum(0)
    assert cumulative[1] < 0.8 <= cumulative[2]
    assert set(_draws(logits, SamplingParams(temperature=0.0), 50).tolist()) == {0}
    assert set(_draws(logits, SamplingParams(top_k=2), 400).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(top_p=0.8), 800).tolist()) == {0, 1, 2}


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = _draws(logits, SamplingParams(temperature=0.05), 200)
    hot = _draws(logits, SamplingParams(temperature=50.0), 900)
    assert set(cold.tolist()) == {0}
    assert (torch.bincount(hot, minlength=3) > 250).all()


def test_seeds_reproduce_and_ignore_the_rest_of_the_batch():
    logits = torch.zeros(3, 1000)
    params = [SamplingParams(seed=1), SamplingParams(seed=2), SamplingParams(temperature=0)]
    first = [sample(logits, params, [make_generator(p.seed, "cpu") for p in params]) for _ in range(2)]
    assert torch.equal(first[0], first[1])
    assert first[0][0] != first[0][1]
    alone = sample(logits[:1], params[:1], [make_generator(1, "cpu")])
    assert alone[0] == first[0][0]
    assert make_generator(None, "cpu") is None
