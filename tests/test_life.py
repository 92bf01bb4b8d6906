"""Chapter 一次请求的一生 counts its scenes in engine steps, which do not swing with the machine's
load as times do: one long prompt against the same tokens in eight pieces, the KV blocks a prompt
holds when its prefill ends, a contract that, unchunked, holds up everyone behind it and, chunked,
rides in the first step of those ahead, and a pool too small for the crowd."""
import pytest
import torch

from minillm import LLM, SamplingParams, load_model
from minillm.lab import estimate as L
from minillm.lab.notebook import room

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(one_thread):
    return load_model("tiny", device="cpu", dtype=torch.float32, weights="random")


def run(model, prompts, max_tokens, num_kv_blocks=128, **settings):
    llm = LLM(model, num_kv_blocks=num_kv_blocks, block_size=BLOCK, enable_prefix_caching=False, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False), llm.stats()


def first_token_steps(outputs, stats):
    """As the lab counts them: the step (from 1) at whose end each request got its first token."""
    ends = {s["end"]: i + 1 for i, s in enumerate(stats["steps"])}
    return [ends[o.metrics.first_token_time] for o in outputs]


def test_one_long_prompt_waits_more_steps_than_its_pieces(tiny):
    """A (256 tokens) against B (its eight pieces) at budgets of one piece, of two (the lab's budget:
    a quarter of the contract) and of the whole prompt."""
    prompt = list(range(3, 259))
    pieces = [prompt[i * 32:(i + 1) * 32] for i in range(8)]
    one, two, whole = ({part: run(tiny, prompts, 2, max_num_batched_tokens=budget) for part, prompts in
                        (("A", [prompt]), ("B", pieces))} for budget in (32, 64, 256))
    assert [len(r["A"][1]["steps"]) for r in (one, two, whole)] == [256 // 32 + 1, 256 // 64 + 1, 256 // 256 + 1]
    a_step, b_steps = first_token_steps(*one["A"])[0], first_token_steps(*one["B"])
    assert a_step == 8 and sum(b_steps) / 8 < a_step and b_steps == sorted(set(b_steps))  # one piece after another
    a_step, b_steps = first_token_steps(*two["A"])[0], first_token_steps(*two["B"])
    assert a_step == 4 and b_steps[:2] == [1, 1] and sum(b_steps) / 8 < a_step  # two pieces finish in the first step
    assert first_token_steps(*whole["B"]) == [1] * 8  # a large budget: all eight pieces in one step


def test_a_prompt_holds_the_ledgers_kv_when_its_prefill_ends(tiny):
    outputs, stats = run(tiny, [list(range(3, 259))], 2, max_num_batched_tokens=64)
    held = stats["num_kv_blocks"] - min(s["num_free_blocks"] for s in stats["steps"] if s["num_prefill_tokens"])
    assert held == 256 // BLOCK and held * BLOCK * L.kv_bytes_per_token(tiny.config, "float32") == L.kv_bytes(
        tiny.config, 256, "float32")


def test_an_unchunked_contract_holds_up_the_questions_behind_it(tiny):
    prompts = [[9] * 20] * 3 + [[4] * 300] + [[9] * 20] * 3
    ahead_done = {}
    for chunked in (False, True):
        outputs, stats = run(tiny, prompts, 8, max_num_batched_tokens=300, enable_chunked_prefill=chunked)
        ahead, behind = [o.metrics for o in outputs[:3]], [o.metrics for o in outputs[4:]]
        ahead_done[chunked] = max(m.finish_time for m in ahead) <= min(m.first_scheduled_time for m in behind)
        assert all(m.queueing > 0 for m in behind)
        first_step = stats["steps"][0]
        assert all(m.first_token_time == first_step["end"] for m in ahead)
        assert ("3" in dict(first_step["scheduled"])) == chunked  # chunked, a piece of the contract rides along
    assert ahead_done == {False: True, True: False}  # unchunked, those behind wait until those ahead finish


def test_a_pool_for_the_contract_and_four_questions_preempts_the_crowd(tiny):
    """Section 6's crowd, the contract eleventh: a pool that holds everyone preempts no one; one that
    holds the contract and four questions (16 new tokens each) preempts, and every request still finishes."""
    prompts = [[9] * 20] * 10 + [[4] * 300] + [[9] * 20] * 9
    small = room([300] + [20] * 4, 16, BLOCK)
    for pool, preempts in ((room(map(len, prompts), 32, BLOCK), False), (small, True)):
        outputs, stats = run(tiny, prompts, 32, num_kv_blocks=pool // BLOCK, max_num_batched_tokens=300)
        assert (stats["num_preemptions"] > 0) == preempts
        assert [len(o.token_ids) for o in outputs] == [32] * 20 and stats["num_free_blocks"] == pool // BLOCK
