"""The engine's sampling features (chapter 解码): penalties and logit bias change the logits as
their formulas say, min_p cuts what it says, logprobs are the model's (the prompt's too: transformers'
float32 values whole or in chunks, with cached or shared blocks about, through preemption), stop strings end the text
exactly where they begin (offline ``LLM`` too), and ``n`` answers to one prompt share its KV blocks
(counted) with every block back in the pool at the end. A tiny random model in float64 for the
values, the real SmolLM2 (and its tokenizer) for the text."""
import functools
import random

import pytest
import torch

import minillm
from minillm import LLM, LLMEngine
from minillm.engine.config import load_config
from minillm.engine.contiguous_cache import ContiguousKVCache
from minillm.engine.generate import _last_logits
from minillm.engine.loader import load_model
from minillm.engine.sampling import (SamplingParams, apply_penalties, make_generator, probabilities,
                                     sample)

CONFIG = load_config("tiny").replace(name="tiny-test", num_layers=2, hidden_size=64,
                                     intermediate_size=128, num_heads=4, num_kv_heads=2,
                                     head_dim=16, vocab_size=128)
PROMPT = [random.Random(3).randrange(CONFIG.vocab_size) for _ in range(21)]

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def tiny_model():
    return load_model(CONFIG, device="cpu", dtype=torch.float64, weights="random")


def next_logits(model, token_ids: list[int]) -> torch.Tensor:
    """The model's logits for the token after ``token_ids``, computed from scratch."""
    cache = ContiguousKVCache(model.config, 1, len(token_ids), model.dtype, model.device)
    return _last_logits(model, cache, [0], [token_ids])[0]


def penalized_by_formula(logits: torch.Tensor, params: SamplingParams, prompt, output) -> list[float]:
    """Each token's logit after bias and penalties, one token at a time in plain Python."""
    out = []
    for token, logit in enumerate(logits.tolist()):
        logit += params.logit_bias.get(token, 0.0)
        if token in prompt or token in output:
            rp = params.repetition_penalty
            logit = logit / rp if logit > 0 else logit * rp
        count = output.count(token)
        out.append(logit - params.frequency_penalty * count - params.presence_penalty * (count > 0))
    return out


PENALTIES = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.7,
                           frequency_penalty=0.9, presence_penalty=0.6, logit_bias={5: 3.0, 9: -2.5})


def test_penalties_and_bias_change_the_logits_as_their_formulas_say():
    model = tiny_model()
    output = [PROMPT[0], 7, 7, 9, 100]  # a prompt token, one repeated, a biased one
    logits = next_logits(model, PROMPT + output)
    plain = SamplingParams(temperature=0.0)
    got = apply_penalties(torch.stack([logits, logits]), [PENALTIES, plain], [PROMPT, PROMPT], [output, output])
    expected = torch.tensor(penalized_by_formula(logits, PENALTIES, PROMPT, output))
    torch.testing.assert_close(got[0], expected.to(logits.dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], logits, rtol=0, atol=0)  # no penalty: as it was
    assert (got[0] != logits).sum() >= 5  # the formula moved the tokens it names


def test_the_engine_applies_penalties_at_every_step():
    """Each greedy token is the argmax of that step's logits penalized by the formula, and the
    answer differs from plain greedy's."""
    llm = LLM(tiny_model(), num_kv_blocks=64, block_size=4)
    (out,) = llm.generate([PROMPT], PENALTIES, use_tqdm=False)
    tokens = out.token_ids
    for k, token in enumerate(tokens):
        logits = next_logits(tiny_model(), PROMPT + tokens[:k])
        scores = penalized_by_formula(logits, PENALTIES, PROMPT, tokens[:k])
        assert token == max(range(len(scores)), key=scores.__getitem__)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    assert tokens != plain
    assert minillm.generate(tiny_model(), [PROMPT], PENALTIES) == [tokens]  # the static loop too
    assert llm.kv_cache.manager.num_free_blocks == 64


def test_a_bias_of_plus_100_forces_a_token_and_minus_100_bans_one():
    llm = LLM(tiny_model(), num_kv_blocks=64, block_size=4)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    forced = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, logit_bias={42: 100})
    banned = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={plain[0]: -100})
    outs = llm.generate([PROMPT, PROMPT], [forced, banned], use_tqdm=False)
    assert outs[0].token_ids == [42] * 8
    assert plain[0] not in outs[1].token_ids and outs[1].token_ids != plain


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_best():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for min_p, kept in ((0.35, {0, 1}), (0.2, {0, 1, 2}), (0.0, {0, 1, 2, 3})):
        params = SamplingParams(min_p=min_p)
        generator = make_generator(0, "cpu")
        draws = {sample(logits, [params], [generator]).item() for _ in range(400)}
        assert draws == kept
        probs = probabilities(logits, [params])[0]  # what speculative decoding compares with
        assert set(probs.nonzero()[:, 0].tolist()) == kept
        torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_logprobs_are_the_models_and_the_top_ones_come_best_first():
    llm = LLM(tiny_model(), num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for k, lp in enumerate(out.logprobs):
        reference = next_logits(tiny_model(), PROMPT + out.token_ids[:k]).log_softmax(-1)
        assert lp.logprob == pytest.approx(reference[lp.token_id].item(), abs=1e-9)
        best = reference.topk(3)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=1e-9)
    none = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert none.logprobs is None and none.new_logprobs is None


def test_bad_values_are_refused_before_anything_is_queued():
    engine = LLMEngine(tiny_model(), num_kv_blocks=16, block_size=4)
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("min_p", 1.5), ("logit_bias", {3: 101}), ("logit_bias", {-1: 1.0}),
                         ("logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", True),
                         ("stop", [1])):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    for params, words in ((SamplingParams(logit_bias={128: 1.0}), "logit_bias: token ids must be in [0, 128)"),
                          (SamplingParams(stop=["x"]), "stop strings need a tokenizer")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
            engine.add_request("r", PROMPT, params)
    assert not engine.has_unfinished() and engine.kv_cache.manager.num_free_blocks == 16
    for params in (SamplingParams(logprobs=1), SamplingParams(prompt_logprobs=0)):
        with pytest.raises(ValueError, match="stop strings and logprobs need the engine"):
            minillm.generate(tiny_model(), [PROMPT], params)


# --- n answers to one prompt ------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [64, 8])
def test_n_answers_share_the_prompt_blocks_and_return_them(budget):
    """A 21-token prompt in blocks of 4: 5 full blocks before the last token, computed by the first
    request (in one step, or in chunks of 8) and shared by the other three, which compute one
    token each; the answers equal the first one's (greedy) and every block returns."""
    engine = LLMEngine(tiny_model(), num_kv_blocks=64, block_size=4, enable_prefix_caching=False,
                       max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a0", PROMPT, params)
    for j in (1, 2, 3):
        engine.add_request(f"a{j}", PROMPT, params, prompt_of="a0")
    outputs, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        running = engine.scheduler.running
        if len(running) == 4:
            peak = max(peak, engine.kv_cache.manager.num_used_blocks)
            shared = [engine.kv_cache.manager.block_table(r.request_id)[:5] for r in running]
            assert all(table == shared[0] for table in shared)
    # 6 blocks for a0's 21 tokens, then 2 more each as 6 tokens grow all four to 27 (7 blocks)
    assert peak == 5 + 4 * 2
    answers = [outputs[f"a{j}"].token_ids for j in range(4)]
    assert answers == [answers[0]] * 4
    assert [outputs[f"a{j}"].num_cached_tokens for j in range(4)] == [0, 20, 20, 20]
    assert engine.kv_cache.manager.num_free_blocks == 64


def test_n_seeded_answers_equal_the_same_requests_alone():
    """Shared blocks change no token: each sampled answer equals its request run alone."""
    model = tiny_model()
    engine = LLMEngine(model, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=5, ignore_eos=True) for s in range(3)]
    for j, p in enumerate(params):
        engine.add_request(f"s{j}", PROMPT, p, prompt_of="s0" if j else None)
    together = {}
    while engine.has_unfinished():
        together.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    llm = LLM(model, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    alone = [llm.generate([PROMPT], p, use_tqdm=False)[0].token_ids for p in params]
    assert [together[f"s{j}"] for j in range(3)] == alone
    assert len({tuple(a) for a in alone}) > 1


def test_prompt_of_must_name_an_unfinished_request_with_the_same_prompt():
    engine = LLMEngine(tiny_model(), num_kv_blocks=16, block_size=4)
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=2))
    for parent, prompt in (("nobody", PROMPT), ("p", PROMPT[:-1])):
        with pytest.raises(ValueError, match="prompt_of"):
            engine.add_request("c", prompt, SamplingParams(max_tokens=2), prompt_of=parent)
    engine.abort("p")
    engine.step()
    assert not engine.has_unfinished() and engine.kv_cache.manager.num_free_blocks == 16


# --- the prompt's logprobs ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny transformers Llama with every parameter random, saved, and its float32 logprobs of PROMPT."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("prompt-logprobs")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
        reference = hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    hf.save_pretrained(folder)
    return folder, reference


def assert_prompt_logprobs(got, reference, num_top: int) -> None:
    """``got`` (an output's prompt_logprobs) holds, for each prompt token after the first, its
    logprob and the ``num_top`` best ones in ``reference``'s row before it."""
    assert len(got) == len(PROMPT) and got[0] is None
    for k, entry in enumerate(got[1:], 1):
        row = reference[k - 1]
        assert entry.token_id == PROMPT[k]
        assert entry.logprob == pytest.approx(row[PROMPT[k]].item(), abs=2e-5)
        best = row.topk(num_top)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=2e-5)


@pytest.mark.parametrize("budget", [None, 5, 8])
def test_prompt_logprobs_are_transformers_float32_whole_or_in_chunks(hf_checkpoint, budget):
    """Every prompt token's logprob and top 3 are log_softmax of transformers' float32 logits at
    the position before it, with the prompt computed in one step or in chunks of 5 or 8 and its
    rows scored two at a time (max_num_seqs=2); the generated tokens are those of a request that
    asks for none."""
    folder, reference = hf_checkpoint
    llm = LLM(folder, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4, max_num_seqs=2,
              **({} if budget is None else dict(max_num_batched_tokens=budget, enable_chunked_prefill=True)))
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    asking, plain = llm.generate([PROMPT, PROMPT[:9]], [SamplingParams(**greedy, prompt_logprobs=3),
                                                        SamplingParams(**greedy)], use_tqdm=False)
    assert_prompt_logprobs(asking.prompt_logprobs, reference, 3)
    assert plain.prompt_logprobs is None and asking.logprobs is None
    alone = llm.generate([PROMPT], SamplingParams(**greedy), use_tqdm=False)[0]
    assert asking.token_ids == alone.token_ids
    assert llm.kv_cache.manager.num_free_blocks == 64


def test_prompt_logprobs_skip_cached_and_shared_blocks(hf_checkpoint):
    """With PROMPT's blocks in the prefix cache, a request asking for its prompt's logprobs takes
    no hit (it computes every position, and scores each), while one that asks for none takes
    them; an answer made ``prompt_of`` another computes its own prompt when it asks, shares the
    blocks when it does not; every answer is the same greedy one."""
    folder, reference = hf_checkpoint
    engine = LLMEngine(folder, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(requests):
        for request_id, params, parent in requests:
            engine.add_request(request_id, PROMPT, params, prompt_of=parent)
        outs = {}
        while engine.has_unfinished():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        return outs

    run([("warm", SamplingParams(**greedy), None)])
    outs = run([("ask", SamplingParams(**greedy, prompt_logprobs=1), None),
                ("ask-too", SamplingParams(**greedy, prompt_logprobs=2), "ask"),
                ("plain", SamplingParams(**greedy), "ask")])
    assert {r: o.num_cached_tokens for r, o in outs.items()} == {"ask": 0, "ask-too": 0, "plain": 20}
    assert_prompt_logprobs(outs["ask"].prompt_logprobs, reference, 1)
    assert_prompt_logprobs(outs["ask-too"].prompt_logprobs, reference, 2)
    assert run([("hit", SamplingParams(**greedy), None)])["hit"].num_cached_tokens == 20
    assert len({tuple(o.token_ids) for o in outs.values()}) == 1
    assert engine.kv_cache.manager.num_used_blocks == 0


def test_prompt_logprobs_are_scored_once_through_preemption(hf_checkpoint):
    """A pool too small for three answers that differ (seeded draws) preempts by recompute: a
    preempted request computes its prompt again but scores it once, and its logprobs stay the model's."""
    folder, reference = hf_checkpoint
    llm = LLM(folder, device="cpu", dtype=torch.float32, num_kv_blocks=16, block_size=4)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
              for seed in range(3)]
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for out in outs:
        assert_prompt_logprobs(out.prompt_logprobs, reference, 2)


# --- stop strings, offline, on the real model -------------------------------------------------------

@pytest.fixture(scope="module")
def smollm():
    return LLM("smollm2-135m", device="cpu", dtype=torch.float32, num_kv_blocks=64)


def test_stop_strings_end_the_text_exactly_before_them(smollm):
    prompt = smollm.chat_prompt_ids([{"role": "user", "content": "Explain the KV cache in three sentences."}])
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    (full,) = smollm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)
    stop = full.text[25:29]
    cut = full.text[:full.text.index(stop)]
    (stopped,) = smollm.generate([prompt], SamplingParams(**greedy, stop=[stop, "never seen"]), use_tqdm=False)
    assert (stopped.text, stopped.finish_reason) == (cut, "stop")
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) < 40
    assert smollm.tokenizer.decode(stopped.token_ids).startswith(cut + stop)  # its last token completed it
    pieces, last = [], None
    smollm.add_request("streamed", prompt, SamplingParams(**greedy, stop=stop))
    while smollm.has_unfinished():
        for out in smollm.step():
            pieces.append(out.new_text)
            last = out
    assert "".join(pieces) == last.text == cut and last.finish_reason == "stop"
    assert smollm.kv_cache.manager.num_free_blocks == 64


def test_speculative_decoding_keeps_penalties_logprobs_and_n():
    """With prompt-lookup proposals verified several a step, a penalized request's greedy tokens,
    a request's logprobs and n shared answers are those of one token a step."""
    stretch = [random.Random(9).randrange(CONFIG.vocab_size) for _ in range(6)]
    prompt = (stretch * 5)[:27]  # repetitive: proposals find matches
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=0.3,
                             repetition_penalty=1.05)]

    def run(speculative_config):
        engine = LLMEngine(tiny_model(), num_kv_blocks=64, block_size=4, speculative_config=speculative_config)
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", prompt, p)
        engine.add_request("r2", prompt, params[0], prompt_of="r0")
        outs = {}
        while engine.has_unfinished():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        assert engine.kv_cache.manager.num_free_blocks == 64
        return outs, engine.stats()

    off, _ = run(None)
    on, stats = run({"method": "ngram", "num_speculative_tokens": 3})
    assert stats["num_accepted_tokens"] > 0
    assert [on[f"r{i}"].token_ids for i in range(3)] == [off[f"r{i}"].token_ids for i in range(3)]
    assert on["r2"].token_ids == on["r0"].token_ids
    for got, want in zip(on["r0"].logprobs, off["r0"].logprobs, strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-9)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
