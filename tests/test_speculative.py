"""Speculative decoding (minillm.engine.speculative), by prompt lookup and by a draft of the
target's own first layers: the proposer and the acceptance rule on known token lists, and the
engine with speculation on giving the same greedy tokens as with it off (float64 on the CPU), in
mixed batches with chunked prefill, prefix hits, preemption, min_tokens, stop tokens, max_tokens
and max_model_len, with the acceptance counted (in all and by position) and every KV block back in
the pool; the draft's KV writes equal the verify step's."""
import functools
import json
import random

import pytest
import torch

from minillm import LLM
from minillm.engine.config import load_config
from minillm.engine.engine_config import EngineConfig, SpeculativeConfig
from minillm.engine.loader import load_model
from minillm.engine.paging import KVCacheManager
from minillm.engine.sampling import SamplingParams
from minillm.engine.speculative import NgramProposer, accept_greedy, accept_sampled

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = load_config("tiny").replace(name="tiny-test", num_layers=2, hidden_size=64,
                                     intermediate_size=128, num_heads=4, num_kv_heads=2,
                                     head_dim=16, vocab_size=128)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_layers", "num_draft_layers": 1, "num_speculative_tokens": 3}  # of CONFIG's 2


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


def test_a_truncated_table_row_is_written_again_where_it_grows_back():
    """The block a truncate gives back may go to another request; the row that grows back over it
    must then name its new block, not the old one."""
    from minillm.engine.paged_cache import PagedKVCache

    cache = PagedKVCache(CONFIG, num_blocks=6, block_size=4)
    assert cache.allocate("a", 10)
    cache.block_tables(["a"])
    cache.truncate("a", 6)  # its third block goes back...
    assert cache.allocate("b", 4)  # ...and "b" takes it
    assert cache.allocate("a", 10)
    a, b = cache.manager.block_table("a"), cache.manager.block_table("b")
    assert a[2] != b[0]
    assert cache.block_tables(["a", "b"])[:, :3].tolist() == [a, b + [0, 0]]


def test_the_planner_sizes_the_sampler_for_every_verified_position():
    """With k proposals a request samples k + 1 rows: the planned step has up to max_num_seqs x
    (k + 1) of them, within the token budget, and its activation peak grows by the sampler's."""
    from minillm.engine.planner import plan, sampler_peak_bytes

    settings = dict(gpu_memory="24GiB", max_model_len=4096, max_num_seqs=64)
    plain = plan("llama-3.1-8b", **settings)
    spec = plan("llama-3.1-8b", **settings, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    vocab = load_config("llama-3.1-8b").vocab_size
    grown = sampler_peak_bytes(64 * 5, vocab) - sampler_peak_bytes(64, vocab)
    assert spec.activation_peak_bytes - plain.activation_peak_bytes == grown > 0
    assert spec.num_blocks < plain.num_blocks


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
    """Chunked prefill (budget 16), two prompts sharing a prefix, a sampled request beside the
    greedy ones, min_tokens with EOS live, a stop token met mid-answer, max_tokens."""
    base = repetitive(1, 7, 30)
    prompts = [base, repetitive(2, 5, 21), base + repetitive(3, 4, 9), repetitive(4, 6, 26), base[:13]]
    plain = [greedy(40, ignore_eos=True), SamplingParams(temperature=0.8, max_tokens=24, seed=5, ignore_eos=True),
             greedy(30, min_tokens=25), greedy(36, ignore_eos=True), greedy(19, ignore_eos=True)]
    off, _, _, _ = generate(None, prompts, plain)
    stop = off[3][17]  # a token of prompt 3's answer ends it where it first occurs
    first = off[3].index(stop)
    params = plain[:3] + [greedy(36, ignore_eos=True, stop_token_ids=(stop,)), plain[4]]
    off, off_stats, _, _ = generate(None, prompts, params)
    on, stats, requests, llm = generate(NGRAM, prompts, params)
    assert on[:1] + on[2:] == off[:1] + off[2:]  # the greedy ones; the sampled one draws differently
    assert len(on[1]) == len(off[1]) == 24
    assert len(on[3]) == first + 1 and on[3][-1] == stop
    assert [len(t) for t in on[:1] + on[4:]] == [40, 19] and len(on[2]) >= 25
    assert stats["num_accepted_tokens"] > 0 and stats["num_steps"] < off_stats["num_steps"]
    assert stats["generation_tokens"] == off_stats["generation_tokens"] == sum(map(len, on))
    assert 0 < stats["num_drafts"] <= stats["num_draft_tokens"]
    assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert sum(s["num_accepted_tokens"] for s in stats["steps"]) == stats["num_accepted_tokens"]
    assert sum(s["num_draft_tokens"] for s in stats["steps"]) == stats["num_draft_tokens"]
    assert all(sum(n for _, n in s["scheduled"]) == s["num_prefill_tokens"] + s["num_decode_tokens"]
               + s["num_draft_tokens"] for s in stats["steps"])
    assert all(len(r.metrics.token_times) == len(r.output_token_ids) for r in requests.values())
    assert off_stats["num_draft_tokens"] == 0
    assert_all_blocks_back(llm)


@pytest.mark.parametrize("mode, prefix", [("recompute", {}), ("swap", {"prefix_index": "radix"}),
                                          ("recompute", {"enable_prefix_caching": False})])
def test_speculation_is_exact_under_preemption_and_max_model_len(mode, prefix):
    """A pool too small for the batch (requests preempted, by recompute and by swap; either prefix
    index, or none) and a max_model_len that ends a request by length mid-proposal."""
    prompts = [repetitive(s, 5 + s, 18 + 3 * s) for s in range(4)]
    params = [greedy(30, ignore_eos=True)] * 4
    args = {"num_kv_blocks": 24, "preemption_mode": mode, "max_model_len": 44, **prefix}
    off, _, _, _ = generate(None, prompts, params, **args)
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


def test_metrics_export_the_speculation_counters_under_vllms_names():
    from prometheus_client.parser import text_string_to_metric_families

    from minillm.server.metrics import ServerMetrics

    _, stats, _, llm = generate(NGRAM, [repetitive(7, 6, 36)], [greedy(24, ignore_eos=True)])
    values = {s.name: s.value for f in text_string_to_metric_families(
        ServerMetrics("m", llm.snapshot(), llm.config).render().decode()) for s in f.samples}
    for name, key in (("drafts", "num_drafts"), ("draft_tokens", "num_draft_tokens"),
                      ("accepted_tokens", "num_accepted_tokens")):
        assert values[f"minillm:spec_decode_num_{name}_total"] == stats[key] > 0
    per_pos = {s.labels["position"]: s.value for f in text_string_to_metric_families(
        ServerMetrics("m", llm.snapshot(), llm.config).render().decode()) for s in f.samples
        if s.name == "minillm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {str(i): n for i, n in enumerate(stats["num_accepted_tokens_per_pos"])}
    assert len(per_pos) == NGRAM["num_speculative_tokens"]


def test_accepted_tokens_are_counted_by_position():
    """Position i is accepted only after position i - 1 was: the counts never grow along the
    positions, the first equals the drafts that had any proposal accepted, they add up to the
    accepted tokens, and the run's counts equal those summed from the step log's requests."""
    _, stats, requests, llm = generate(NGRAM, [repetitive(s, 5 + s, 30) for s in range(3)],
                                       [greedy(30, ignore_eos=True)] * 3)
    per_pos = stats["num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == stats["num_accepted_tokens"] > 0
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= stats["num_drafts"]
    rejected = sum(sum(s["num_rejected"].values()) for s in stats["steps"])
    assert rejected == stats["num_draft_tokens"] - stats["num_accepted_tokens"] > 0
    assert llm.snapshot()["num_accepted_tokens_per_pos"] == per_pos  # one run since the start
    llm.reset_metrics()
    assert llm.stats()["num_accepted_tokens_per_pos"] == [0, 0, 0]


def test_serve_takes_a_speculative_config_as_json():
    from minillm.__main__ import build_parser

    args = build_parser().parse_args(["serve", "tiny", "--speculative-config", json.dumps(NGRAM)])
    assert args.speculative_config == NGRAM
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "tiny", "--speculative-config", "{method: ngram}"])


# -- the draft of the target's first layers ---------------------------------------------------------
def test_draft_layers_takes_its_keys_and_refuses_a_separate_model():
    config = EngineConfig(speculative_config=DRAFT)
    assert config.speculative_config == SpeculativeConfig("draft_layers", 3, num_draft_layers=1)
    for bad, message in [({"model": "smollm2-135m", "num_speculative_tokens": 3}, "separate draft model"),
                         ({"method": "draft_model", "num_speculative_tokens": 3}, "separate draft model"),
                         ({"method": "draft_layers", "num_speculative_tokens": 3}, "num_draft_layers"),
                         ({**DRAFT, "num_draft_layers": 0}, "num_draft_layers"),
                         ({**DRAFT, "prompt_lookup_max": 2}, "unknown keys"),
                         ({**NGRAM, "num_draft_layers": 1}, "unknown keys")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)


def test_a_draft_of_every_layer_is_refused_before_the_pool_is_allocated():
    """A pool of 10^9 blocks could not be allocated: the error is the draft's, so it came first."""
    for layers in (2, 5):
        with pytest.raises(ValueError, match=r"num_draft_layers must be in \[1, 1\] \(the model has 2"):
            LLM(tiny_model(), num_kv_blocks=10**9, speculative_config={**DRAFT, "num_draft_layers": layers})


def test_draft_layers_greedy_tokens_equal_those_without_in_a_mixed_batch():
    """Chunked prefill (budget 16), a shared prefix, a sampled request beside the greedy ones,
    min_tokens with EOS live, max_tokens; then a pool too small (preemption by recompute and by
    swap) with max_model_len ending the requests mid-proposal."""
    base = repetitive(1, 7, 30)
    prompts = [base, repetitive(2, 5, 21), base + repetitive(3, 4, 9), base[:13]]
    params = [greedy(40, ignore_eos=True), SamplingParams(temperature=0.8, max_tokens=24, seed=5, ignore_eos=True),
              greedy(30, min_tokens=25), greedy(19, ignore_eos=True)]
    off, _, _, _ = generate(None, prompts, params)
    on, stats, _, llm = generate(DRAFT, prompts, params)
    assert on[:1] + on[2:] == off[:1] + off[2:] and len(on[1]) == 24
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert stats["prefix_hit_tokens"] > 0 and stats["generation_tokens"] == sum(map(len, on))
    assert sum(s["num_draft_tokens"] for s in stats["steps"]) == stats["num_draft_tokens"]
    assert_all_blocks_back(llm)
    for mode in ("recompute", "swap"):
        args = {"num_kv_blocks": 24, "preemption_mode": mode, "max_model_len": 44}
        prompts = [repetitive(s, 5 + s, 18 + 3 * s) for s in range(4)]
        off, _, _, _ = generate(None, prompts, [greedy(30, ignore_eos=True)] * 4, **args)
        on, stats, _, llm = generate(DRAFT, prompts, [greedy(30, ignore_eos=True)] * 4, **args)
        assert on == off and stats["num_preemptions"] > 0 and stats["num_accepted_tokens"] > 0
        assert_all_blocks_back(llm)


def test_the_drafts_kv_writes_are_the_ones_the_verify_step_makes():
    """The draft writes layer 0's keys and values at the slots it drafts; the verify step writes
    the same values there, to within float64 rounding (one position at a time against several:
    the matmuls sum in another order), and the other layers' too: the draft needs no cache of
    its own."""
    engine = LLM(tiny_model(), num_kv_blocks=64, block_size=4, speculative_config=DRAFT)
    engine.add_request("a", repetitive(1, 7, 30), greedy(20, ignore_eos=True))
    compared = 0
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        drafted = [r for r, _ in out.scheduled if r.num_spec_tokens]
        if drafted:
            (request,) = drafted
            engine.runner.draft.propose(drafted, {})
            blocks, offsets = zip(*(position_slot(engine.kv_cache, request, p) for p in
                                    range(request.num_tokens - 1, request.num_tokens - 1 + request.num_spec_tokens)))
            draft_kv = engine.kv_cache.kv[0][:, list(blocks), list(offsets)].clone()
            request.spec_token_ids = []  # the step drafts them again, the same way
            sampled = engine.runner.execute(out)
            verify_kv = engine.kv_cache.kv[0][:, list(blocks), list(offsets)]
            assert torch.allclose(verify_kv, draft_kv, rtol=0, atol=1e-12) and draft_kv.abs().max() > 0
            compared += len(blocks)
        else:
            sampled = engine.runner.execute(out)
        engine.scheduler.update(out, sampled)
    assert compared >= 10


def position_slot(cache, request, position):
    """(block, offset) of a request's position in the paged cache."""
    return cache.manager.block_table(request.request_id)[position // cache.block_size], position % cache.block_size


def test_draft_probabilities_are_the_q_of_the_rejection_sampler():
    """20,000 verify steps of one proposal drawn from q over a 4-token vocabulary: the first token
    follows p (chi-square p-value above 1e-3), and the proposal is accepted at the rate
    sum(min(p, q)) (within 0.02)."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]], dtype=torch.float64)
    generator, draws = torch.Generator().manual_seed(0), 20_000
    outs = []
    for _ in range(draws):
        x = int(torch.multinomial(q[0], 1, generator=generator))
        outs.append(accept_sampled([x], p, generator, q))
    firsts = [o[0] for o in outs]
    counts = {t: firsts.count(t) for t in range(4)}
    assert chi_square_p_value(counts, {t: draws * float(p[0, t]) for t in range(4)}) > 1e-3, counts
    accepted = sum(len(o) == 2 for o in outs) / draws
    assert abs(accepted - float(torch.minimum(p[0], q[0]).sum())) < 0.02


def test_draft_layers_sampled_tokens_follow_the_targets_distribution():
    """As the n-gram test below, each request drafting with the first layer."""
    assert_pairs_follow_target(DRAFT, repetitive(3, 7, 40), num_kv_blocks=3000)


# -- the real model --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", device="cpu", dtype=torch.float64)


def test_smollm2_greedy_tokens_with_speculation_equal_those_without(smollm2):
    """Chats that ask for text the answer repeats (n-gram proposals hit), with one open question, in
    one batch: their prompts cut in chunks of the 64-token budget, their shared system prompt a
    prefix-cache hit. By prompt lookup and by a draft of the first 24 of the 30 layers."""
    chats = ["Repeat this sentence three times: the cache keeps the keys and values of every token.",
             "Copy this list exactly: red apple, green pear, red apple, green pear, yellow plum.",
             "What is a GPU good at?"]
    params = [greedy(40), greedy(36), greedy(24)]
    results = []
    draft = {"method": "draft_layers", "num_draft_layers": 24, "num_speculative_tokens": 3}
    for spec in (None, NGRAM, draft):
        llm = LLM(smollm2, num_kv_blocks=64, max_num_batched_tokens=64, speculative_config=spec)
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": c}]) for c in chats]
        results.append(([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm.stats()))
        assert_all_blocks_back(llm)
    (off, off_stats), *with_spec = results
    for on, stats in with_spec:
        assert on == off
        assert stats["num_accepted_tokens"] > 0 and stats["num_steps"] < off_stats["num_steps"]
        assert stats["prefix_hit_tokens"] > 0 and max(s["num_prefill_tokens"] for s in stats["steps"]) == 64


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
    assert result["task"] == "grounded"
    assert result["cpu_threads"] == 1  # the labs' policy by default
    assert result["speedup"] == result["off_s"] / result["on_s"]
    assert result["tokens_per_step_off"] == 1.0 < result["tokens_per_step_on"]  # one request: a token a step off
    assert result["generation_tokens"] == 12
    assert 0 < result["num_accepted_tokens"] <= result["num_draft_tokens"]
    assert result["acceptance_rate"] == result["num_accepted_tokens"] / result["num_draft_tokens"]
    assert 1 < result["mean_accepted_length"] <= 1 + result["speculative_config"]["num_speculative_tokens"]
    # α: accepted over compared (the accepted ones and one per verify that stopped at a miss)
    assert 0 <= result["num_missed_drafts"] <= result["num_drafts"]
    compared = result["num_accepted_tokens"] + result["num_missed_drafts"]
    assert result["alpha"] == result["num_accepted_tokens"] / compared >= result["acceptance_rate"]


def test_bench_speculative_prices_a_draft_of_the_first_layers(capsys):
    from minillm.__main__ import main

    assert main(["bench", "speculative", "--method", "draft_layers", "--draft-layers", "20", "--max-tokens", "10",
                 "--repeats", "1", "--device", "cpu", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["identical"] and r["speculative_config"]["num_draft_layers"] == 20
    assert 0 < r["draft_cost"] == r["draft_pass_s"] / r["target_step_s"]
    assert r["verify_cost"] == r["verify_step_s"] / r["target_step_s"] > 0
    assert r["predicted_speedup"] == pytest.approx(
        r["mean_accepted_length"] / (r["proposals_per_verify"] * r["draft_cost"] + r["verify_cost"]))
    assert 1 <= r["proposals_per_verify"] <= 4
    assert main(["bench", "speculative", "--method", "draft_layers", "--device", "cpu"]) != 0  # no --draft-layers
    assert "num_draft_layers'] must be a positive int" in capsys.readouterr().err


def test_bench_speculative_prompts_by_task():
    from minillm.lab.bench_speculative import OPEN_QUESTIONS, bench_speculative, grounded_prompts, open_prompts

    assert open_prompts(len(OPEN_QUESTIONS) + 1) == [*OPEN_QUESTIONS, OPEN_QUESTIONS[0]]
    first, second = grounded_prompts(2)
    assert first.startswith("Repeat the following text word for word:") and first != second
    with pytest.raises(ValueError, match="task"):
        bench_speculative(task="summary")  # before any model is loaded


# -- temperature > 0: the rejection sampling ---------------------------------------------------------
def target_probs(params, token_ids):
    """The target's distribution for the token after ``token_ids`` under ``params`` (one prefill)."""
    from minillm.engine.contiguous_cache import ContiguousKVCache
    from minillm.engine.sampling import probabilities

    model = tiny_model()
    cache = ContiguousKVCache(model.config, 1, len(token_ids), model.dtype, model.device)
    positions, attn = cache.append([0], [len(token_ids)])
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), positions, attn, cache.layer_caches)
        return probabilities(model.compute_logits(hidden[-1:]), [params])[0]


def chi_square_p_value(counts: dict, expected: dict) -> float:
    """The p-value of Pearson's chi-square statistic of ``counts`` against ``expected`` (same keys)."""
    chi2 = sum((counts[c] - e) ** 2 / e for c, e in expected.items())
    return float(torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def test_rejection_sampling_draws_each_position_from_the_target():
    """20,000 verify steps of two proposals over a 4-token vocabulary: the first token follows p0,
    the second, after the first proposal was accepted, follows p1, the third p2 (chi-square
    p-values above 1e-3); a point-mass draft accepts its token with probability p(token)."""
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]],
                         dtype=torch.float64)
    generator, draws = torch.Generator().manual_seed(0), 20_000
    outs = [accept_sampled([2, 1], probs, generator) for _ in range(draws)]
    for position, prefix in enumerate([[], [2], [2, 1]]):
        tails = [o[position] for o in outs if o[:position] == prefix and len(o) > position]
        counts = {t: tails.count(t) for t in range(4)}
        expected = {t: len(tails) * float(probs[position, t]) for t in range(4)}
        assert chi_square_p_value(counts, expected) > 1e-3, (position, counts, expected)
    accepted_first = sum(o[0] == 2 for o in outs) / draws
    assert abs(accepted_first - 0.2) < 0.02 and all(1 <= len(o) <= 3 for o in outs)


def prompt_lookup_hits_for(params):
    """A random prompt that holds every token the target may sample after it (so prompt lookup
    proposes a token at the first decode step whichever comes first), one of whose proposals the
    target may sample too (so proposals are accepted as well as rejected); found by search."""
    for seed in range(1000):
        rng = random.Random(seed)
        prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(48)]
        firsts = target_probs(params, prompt).nonzero().flatten().tolist()
        if not all(t in prompt[:-1] for t in firsts):
            continue
        proposals = {t: prompt[max(i for i, p in enumerate(prompt[:-1]) if p == t) + 1] for t in firsts}
        if any(target_probs(params, prompt + [t])[x] > 0 for t, x in proposals.items()):
            return prompt
    raise AssertionError("no such prompt among the seeds tried")


def test_sampled_tokens_with_speculation_follow_the_targets_distribution():
    """3000 requests with seeds 0.., temperature 1.5 and top_k 3, on a prompt whose n-grams
    propose a token at the first decode step: see assert_pairs_follow_target."""
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    assert_pairs_follow_target(NGRAM, prompt_lookup_hits_for(params), num_kv_blocks=2048)


def assert_pairs_follow_target(speculative, prompt, num_kv_blocks, samples=3000):
    """Sample ``samples`` seeded requests (temperature 1.5, top_k 3) with ``speculative`` on; the
    pair (first, second) token is counted and tested against the target's exact joint distribution
    p(t1) p(t2 | t1) (9 cells) by a chi-square test: its p-value must exceed 1e-3. The proposals
    must have been both accepted and rejected, so that both branches of the rejection sampling
    were drawn from."""
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    seeded = [SamplingParams(**{**vars(params), "seed": seed}) for seed in range(samples)]
    on, stats, _, llm = generate(speculative, [prompt] * samples, seeded, num_kv_blocks=num_kv_blocks,
                                 max_num_batched_tokens=2048)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    first = target_probs(params, prompt)
    expected = {}
    for t1 in first.nonzero().flatten().tolist():
        second = target_probs(params, prompt + [t1])
        for t2 in second.nonzero().flatten().tolist():
            expected[t1, t2] = samples * float(first[t1] * second[t2])
    counts = {cell: 0 for cell in expected}
    for tokens in on:
        counts[tokens[0], tokens[1]] += 1  # a pair outside the support raises KeyError
    assert len(expected) == 9 and chi_square_p_value(counts, expected) > 1e-3, (counts, expected)
    assert_all_blocks_back(llm)
