"""Chapter 一次请求的一生 counts its scenes in engine steps, which do not swing with the machine's
load as times do: one long prompt against the same tokens in eight pieces, the KV blocks a prompt
holds when its prefill ends, and a contract that, unchunked, holds up everyone behind it."""
import pytest
import torch

from minillm import LLM, SamplingParams, load_model
from minillm.lab import estimate as L

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(one_thread):
    return load_model("tiny", device="cpu", dtype=torch.float32, weights="random")


def run(model, prompts, max_tokens, **settings):
    llm = LLM(model, num_kv_blocks=128, block_size=BLOCK, enable_prefix_caching=False, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False), llm.stats()


def first_token_steps(outputs, stats):
    """As the lab counts them: the step (from 1) at whose end each request got its first token."""
    ends = {s["end"]: i + 1 for i, s in enumerate(stats["steps"])}
    return [ends[o.metrics.first_token_time] for o in outputs]


def test_one_long_prompt_waits_more_steps_than_its_pieces(tiny):
    prompt = list(range(3, 259))
    pieces = [prompt[i * 32:(i + 1) * 32] for i in range(8)]
    small, large = ({part: run(tiny, prompts, 2, max_num_batched_tokens=budget) for part, prompts in
                     (("A", [prompt]), ("B", pieces))} for budget in (32, 256))
    assert [len(r["A"][1]["steps"]) for r in (small, large)] == [256 // 32 + 1, 256 // 256 + 1]
    a_step, b_steps = first_token_steps(*small["A"])[0], first_token_steps(*small["B"])
    assert a_step == 8 and sum(b_steps) / 8 < a_step and b_steps == sorted(set(b_steps))  # one piece after another
    assert first_token_steps(*large["B"]) == [1] * 8  # a large budget: all eight pieces in one step


def test_a_prompt_holds_the_ledgers_kv_when_its_prefill_ends(tiny):
    outputs, stats = run(tiny, [list(range(3, 259))], 2, max_num_batched_tokens=64)
    held = stats["num_kv_blocks"] - min(s["num_free_blocks"] for s in stats["steps"] if s["num_prefill_tokens"])
    assert held == 256 // BLOCK and held * BLOCK * L.kv_bytes_per_token(tiny.config, "float32") == L.kv_bytes(
        tiny.config, 256, "float32")


def test_an_unchunked_contract_holds_up_the_questions_behind_it(tiny):
    prompts = [[9] * 20] * 3 + [[4] * 300] + [[9] * 20] * 3
    ahead_done = {}
    for chunked in (False, True):
        outputs, _ = run(tiny, prompts, 8, max_num_batched_tokens=300, enable_chunked_prefill=chunked)
        ahead, behind = [o.metrics for o in outputs[:3]], [o.metrics for o in outputs[4:]]
        ahead_done[chunked] = max(m.finish_time for m in ahead) <= min(m.first_scheduled_time for m in behind)
        assert all(m.queueing > 0 for m in behind)
    assert ahead_done == {False: True, True: False}  # unchunked, those behind wait until those ahead finish
