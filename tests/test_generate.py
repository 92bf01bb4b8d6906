"""generate() (chapters 预填充, 解码, KV cache): validation, stop conditions, batching, seeds."""
import pytest
import torch

from minillm import SamplingParams, generate, load_model
from minillm.engine.config import load_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 200, 3], [17], [250, 1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.fixture
def model():
    cfg = load_config("tiny").replace(num_layers=2, vocab_size=256, max_position_embeddings=64)
    return load_model(cfg, device="cpu", dtype=torch.float64, weights="random")


@pytest.mark.parametrize("prompts, params, match", [
    ([], GREEDY, "non-empty list"),
    ([[1], []], GREEDY, "prompt 1 is empty"),
    ([[1], [3, 256]], GREEDY, r"prompt 1 has token id 256 outside the vocabulary \[0, 256\)"),
    ([[1, -1]], GREEDY, "prompt 0 has token id -1"),
    ([[1, None]], GREEDY, "prompt 0 has token id None"),
    (["hello"], GREEDY, "prompt 0 must be a list of token ids"),
    ([[1] * 60], SamplingParams(max_tokens=5), "prompt 0: 60 prompt tokens.*65.*max_position_embeddings 64"),
    ([[1], [2]], [GREEDY], "one per prompt"),
    ([[1]], "greedy", "params must be"),
])
def test_bad_input_is_refused_before_any_compute(model, monkeypatch, prompts, params, match):
    monkeypatch.setattr(model, "forward", lambda *args: pytest.fail("the model ran"))
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, params)


def test_max_tokens_per_request_and_rows_leave_the_batch(model):
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    outs = generate(model, PROMPTS, params)
    assert [len(o) for o in outs] == [12, 3, 1]
    full = generate(model, PROMPTS, GREEDY)
    assert outs[1] == full[1][:3] and outs[2] == full[2][:1]


def test_batched_equals_alone_and_cache_equals_recompute(model):
    batched = generate(model, PROMPTS, GREEDY)
    assert batched == [generate(model, [p], GREEDY)[0] for p in PROMPTS]
    assert batched == generate(model, PROMPTS, GREEDY, use_cache=False)


def _first_new_token(tokens):
    """An index i > 0 whose token did not occur before it, and that token."""
    i = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    return i, tokens[i]


def test_stop_token_ids_and_eos(model):
    full = generate(model, PROMPTS[:1], GREEDY)[0]
    i, token = _first_new_token(full)
    stopped = generate(model, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12,
                                                          stop_token_ids=(token,)))[0]
    assert stopped == full[:i + 1]  # the stop token is returned, nothing after it
    model.config = model.config.replace(eos_token_ids=(token,))
    assert generate(model, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12))[0] == full[:i + 1]
    assert generate(model, PROMPTS[:1], GREEDY)[0] == full  # ignore_eos


def test_seeds_reproduce_whatever_the_batch(model):
    def sampled(seed):
        return SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=seed)

    first = generate(model, PROMPTS, [sampled(1), sampled(2), sampled(1)])
    assert first == generate(model, PROMPTS, [sampled(1), sampled(2), sampled(1)])
    assert first[0] != generate(model, PROMPTS[:1], sampled(3))[0]
    assert first[2] == generate(model, PROMPTS[2:], sampled(1))[0]  # batch-mates do not matter


def test_top_k_one_is_greedy(model):
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True, seed=0)
    assert generate(model, PROMPTS, top1) == generate(model, PROMPTS, GREEDY)
