"""Speculative decoding by prompt lookup (minillm.engine.speculative): the proposer and the
acceptance rule on known token lists, and the engine with speculation on giving the same greedy
tokens as with it off (float64 on the CPU), in mixed batches with chunked prefill, prefix hits,
preemption, min_tokens, stop tokens, max_tokens and max_model_len, with the acceptance counted and
every KV block back in the pool."""
import functools
import random

import pytest
import torch

from minillm import LLM
from minillm.engine.config import load_config
from minillm.engine.engine_config import EngineConfig, SpeculativeConfig
from minillm.engine.loader import load_model
from minillm.engine.paging import KVCacheManager
from minillm.engine.sampling import SamplingParams
from minillm.engine.speculative import NgramProposer, accept_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = load_config("tiny").replace(name="tiny-test", num_layers=2, hidden_size=64,
                                     intermediate_size=128, num_heads=4, num_kv_heads=2,
                                     head_dim=16, vocab_size=128)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def proposer(k=3, high=2, low=1):
    return NgramProposer(SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": high, "prompt_lookup_min": low}))


# -- the proposer and the acceptance rule ------------------------------------------------------------
def test_the_proposer_continues_the_latest_earlier_match_of_the_longest_suffix():
    assert proposer().propose([1, 2, 3, 9, 1, 2], 8) == [3, 9, 1]  # [1, 2] matched at 0
    assert proposer().propose([1, 2, 3, 9, 1, 2], 2) == [3, 9]  # capped by the room left
    assert proposer(k=4).propose([5, 1, 7, 1, 8, 1], 8) == [8, 1]  # [1] at 3, the latest; to the end
    assert proposer(high=2, low=2).propose([5, 1, 7, 1, 8, 1], 8) == []  # [8, 1] never occurred before
    assert proposer(high=3, low=1).propose([4, 6, 2, 4, 6, 3, 6], 8) == [3, 6]  # [4,6] absent; [6] at 4
    assert proposer().propose([7], 8) == [] and proposer().propose([1, 1], 0) == []


def test_acceptance_keeps_the_agreed_proposals_and_the_targets_next_token():
    assert accept_greedy([4, 5, 6], [4, 5, 7, 8]) == [4, 5, 7]  # rejected at the third
    assert accept_greedy([4, 5], [4, 5, 9]) == [4, 5, 9]  # all accepted, plus the bonus token
    assert accept_greedy([1], [2, 3]) == [2]  # none accepted: the target's own token
    with pytest.raises(ValueError, match="one target token per proposal plus one"):
        accept_greedy([1, 2], [1, 2])


def test_speculative_config_takes_vllms_keys_and_refuses_bad_ones():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative_config == SpeculativeConfig("ngram", 2, 5, 5)
    one = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_max, one.prompt_lookup_min) == (3, 3)
    assert EngineConfig().speculative_config is None
    for bad, message in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                         ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                           "prompt_lookup_min": 3}, "exceeds prompt_lookup_max"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
                         ("ngram", "must be a dict")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)


def test_truncate_gives_back_the_blocks_past_the_kept_tokens():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert manager.allocate("a", 6)
    manager.commit("a", list(range(4)))  # one full block committed
    assert manager.allocate("a", 11) and manager.num_free_blocks == 5
    manager.truncate("a", 7)
    assert (manager.num_tokens("a"), len(manager.block_table("a")), manager.num_free_blocks) == (7, 2, 6)
    with pytest.raises(ValueError, match="outside"):
        manager.truncate("a", 3)  # inside the committed block
    manager.free("a")
    assert manager.num_free_blocks == 8


# -- the engine on a tiny model -----------------------------------------------------------------------
@functools.cache
def tiny_model():
    return load_model(CONFIG, device="cpu", dtype=torch.float64, weights="random")


def repetitive(seed, period, length):
    """A prompt that repeats a random stretch of ``period`` tokens: proposals find matches in it."""
    rng = random.Random(seed)
    stretch = [rng.randrange(CONFIG.vocab_size) for _ in range(period)]
    return (stretch * (length // period + 1))[:length]


def generate(speculative_config, prompts, params, **engine_args):
    """(token ids per prompt, the run's stats, the finished requests by id, the engine)."""
    engine_args = {"num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16, **engine_args}
    llm = LLM(tiny_model(), speculative_config=speculative_config, **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    requests = {r.request_id: r for r in llm.recorder.finished}
    return [o.token_ids for o in outputs], llm.stats(), requests, llm


def greedy(max_tokens, **params):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)


def assert_all_blocks_back(llm):
    kv = llm.kv_cache.manager
    assert kv.request_ids == [] and kv.num_free_blocks == kv.num_blocks


def test_greedy_tokens_with_speculation_equal_those_without_in_a_mixed_batch():
    """Chunked prefill (budget 16), two prompts sharing a prefix, a sampled request with a seed (never
    proposed for), min_tokens with EOS live, a stop token met mid-answer, max_tokens."""
    base = repetitive(1, 7, 30)
    prompts = [base, repetitive(2, 5, 21), base + repetitive(3, 4, 9), repetitive(4, 6, 26), base[:13]]
    plain = [greedy(40, ignore_eos=True), SamplingParams(temperature=0.8, max_tokens=24, seed=5),
             greedy(30, min_tokens=25), greedy(36, ignore_eos=True), greedy(19, ignore_eos=True)]
    off, _, _, _ = generate(None, prompts, plain)
    stop = off[3][17]  # a token first met late in prompt 3's answer ends it there
    first = off[3].index(stop)
    params = plain[:3] + [greedy(36, ignore_eos=True, stop_token_ids=(stop,)), plain[4]]
    off, off_stats, _, _ = generate(None, prompts, params)
    on, stats, requests, llm = generate(NGRAM, prompts, params)
    assert on == off
    assert len(on[3]) == first + 1 and on[3][-1] == stop
    assert [len(t) for t in on[:1] + on[4:]] == [40, 19] and len(on[2]) >= 25
    assert stats["num_accepted_tokens"] > 0 and stats["num_steps"] < off_stats["num_steps"]
    assert stats["generation_tokens"] == off_stats["generation_tokens"] == sum(map(len, on))
    assert 0 < stats["num_drafts"] <= stats["num_draft_tokens"]
    assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert sum(s["num_accepted_tokens"] for s in stats["steps"]) == stats["num_accepted_tokens"]
    assert sum(s["num_draft_tokens"] for s in stats["steps"]) == stats["num_draft_tokens"]
    assert sum(r.num_accepted_tokens for r in requests.values()) == stats["num_accepted_tokens"]
    sampled_id = next(i for i, r in requests.items() if not r.params.greedy)
    assert requests[sampled_id].num_draft_tokens == 0
    assert all(len(r.metrics.token_times) == len(r.output_token_ids) for r in requests.values())
    assert off_stats["num_draft_tokens"] == 0
    assert_all_blocks_back(llm)


def test_speculation_is_exact_under_preemption_and_max_model_len():
    """A pool too small for the batch (requests preempted, by recompute and by swap) and a
    max_model_len that ends a request by length mid-proposal."""
    prompts = [repetitive(s, 5 + s, 18 + 3 * s) for s in range(4)]
    params = [greedy(30, ignore_eos=True)] * 4
    for mode in ("recompute", "swap"):
        args = {"num_kv_blocks": 24, "preemption_mode": mode, "max_model_len": 44}
        off, off_stats, _, _ = generate(None, prompts, params, **args)
        on, stats, _, llm = generate(NGRAM, prompts, params, **args)
        assert on == off
        assert [len(p) + len(t) for p, t in zip(prompts, on)] == [44, 44, 44, 44]  # by length
        assert stats["num_preemptions"] > 0 and stats["num_accepted_tokens"] > 0
        assert_all_blocks_back(llm)


def test_acceptance_is_positive_on_a_repetitive_prompt_and_steps_yield_several_tokens():
    on, stats, requests, llm = generate(NGRAM, [repetitive(7, 6, 36)], [greedy(48, ignore_eos=True)],
                                        max_num_batched_tokens=64)
    assert stats["num_accepted_tokens"] > 0
    assert max(s["num_generated"] for s in stats["steps"]) > 1
    assert stats["num_steps"] < 48  # fewer steps than tokens: the prefill step plus the decodes
    assert_all_blocks_back(llm)


# -- the real model --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", device="cpu", dtype=torch.float64)


def test_smollm2_greedy_tokens_with_speculation_equal_those_without(smollm2):
    """Chats that ask for text the answer repeats (n-gram proposals hit), with one open question."""
    chats = ["Repeat this sentence three times: the cache keeps the keys and values of every token.",
             "Copy this list exactly: red apple, green pear, red apple, green pear, yellow plum.",
             "What is a GPU good at?"]
    params = [greedy(40), greedy(36), greedy(24)]
    results = []
    for spec in (None, NGRAM):
        llm = LLM(smollm2, num_kv_blocks=64, max_num_batched_tokens=64, speculative_config=spec)
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": c}]) for c in chats]
        results.append(([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm.stats()))
        assert_all_blocks_back(llm)
    (off, off_stats), (on, stats) = results
    assert on == off
    assert stats["num_accepted_tokens"] > 0 and stats["num_steps"] < off_stats["num_steps"]


def test_min_tokens_holds_at_every_proposed_position():
    """Each request stops on a token of the plain answer, first met at index f, with min_tokens=f:
    the stop token is masked at every proposed position before f, and only there, so each answer is
    the plain one cut after index f, wherever f falls in a verified chunk."""
    prompt = repetitive(1, 7, 30)
    (answer,), _, _, _ = generate(None, [prompt], [greedy(40, ignore_eos=True)])
    firsts = [f for f in range(2, 40) if answer[f] not in answer[:f]]
    assert len(firsts) >= 8  # what the test relies on: stop tokens first met all along the answer
    params = [greedy(40, ignore_eos=True, min_tokens=f, stop_token_ids=(answer[f],)) for f in firsts]
    on, stats, _, llm = generate(NGRAM, [prompt] * len(params), params, max_num_batched_tokens=64)
    assert on == [answer[:f + 1] for f in firsts]
    assert stats["num_accepted_tokens"] > 0
    assert_all_blocks_back(llm)


def test_bench_speculative_prints_its_ratios_as_one_json_object(capsys):
    import json

    from minillm.__main__ import main

    assert main(["bench", "speculative", "--max-tokens", "12", "--repeats", "1", "--device", "cpu",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] and result["model"] == "smollm2-135m" and result["batch"] == 1
    assert result["speedup"] == result["off_s"] / result["on_s"]
    assert result["tokens_per_step_off"] == 1.0 < result["tokens_per_step_on"]  # one request: a token a step off
    assert result["generation_tokens"] == 12
    assert 0 < result["num_accepted_tokens"] <= result["num_draft_tokens"]
    assert result["acceptance_rate"] == result["num_accepted_tokens"] / result["num_draft_tokens"]
    assert 1 < result["mean_accepted_length"] <= 1 + result["speculative_config"]["num_speculative_tokens"]
