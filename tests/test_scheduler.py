"""The scheduler alone (chapter 调度): budgets, chunking, preemption, prefix hits, the static baseline.

A fake model stands in for the forward pass: the token sampled for a request depends only on its
id and how many tokens it has, so any schedule must produce the same tokens.
"""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.config import ModelConfig
from minillm.engine.engine_config import EngineConfig
from minillm.engine.paged_cache import PagedKVCache
from minillm.engine.request import Request, RequestStatus
from minillm.engine.sampling import SamplingParams
from minillm.engine.scheduler import SCHEDULERS

EOS = 2
TOKEN = 7  # what the fake model samples unless told otherwise
SPECK = ModelConfig(name="speck", model_type="llama", vocab_size=16, hidden_size=1, intermediate_size=1,
                    num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, max_position_embeddings=1 << 20)


def make(num_blocks=64, block_size=4, static=False, num_cpu_blocks=0, eos_token_ids=(),
         prefix_caching=True, **settings):
    """A scheduler over a pool of ``num_blocks`` blocks (of a one-element KV cache, the tensors are
    not what it tests); ``settings`` are EngineConfig's."""
    settings.setdefault("max_model_len", num_blocks * block_size)
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks,
                          scheduling="static" if static else "continuous", enable_prefix_caching=prefix_caching,
                          **settings).resolved(SPECK.max_position_embeddings, block_size)
    kv = PagedKVCache(SPECK, num_blocks, block_size, enable_prefix_caching=prefix_caching,
                      max_model_len=config.max_model_len, num_cpu_blocks=config.num_cpu_blocks)
    return SCHEDULERS[config.scheduling](kv, config, eos_token_ids)


_fresh_tokens = itertools.count(1000, 1000)


def req(request_id, prompt_len, max_tokens=4, first_token=None, **params):
    """A request whose prompt shares no prefix with others unless ``first_token`` says so."""
    params.setdefault("ignore_eos", True)
    first_token = next(_fresh_tokens) if first_token is None else first_token
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))


def needs_token(request, num_new):
    return request.num_computed_tokens + num_new == request.num_tokens


def step(scheduler, token=lambda r: TOKEN):
    """One schedule + fake forward + update; returns the SchedulerOutput."""
    out = scheduler.schedule()
    sampled = {r.request_id: [token(r)] for r, n in out.scheduled if needs_token(r, n)}
    scheduler.update(out, sampled)
    return out


def run(scheduler, token=lambda r: TOKEN, max_steps=10_000, outputs=None):
    """Steps until every request finished: list of [(request_id, num_new_tokens), ...] per step
    (and each step's SchedulerOutput appended to ``outputs``)."""
    log = []
    while scheduler.has_unfinished():
        out = step(scheduler, token)
        assert out.scheduled, "no progress"
        log.append([(r.request_id, n) for r, n in out.scheduled])
        if outputs is not None:
            outputs.append(out)
        assert len(log) < max_steps
    return log


def test_running_first_then_waiting_in_arrival_order():
    s = make(max_num_batched_tokens=10)
    s.add_request(req("a", 6))
    assert [(r.request_id, n) for r, n in step(s).scheduled] == [("a", 6)]
    for name in ("b", "c", "d"):
        s.add_request(req(name, 4))
    # a decodes (1 token) first, then b and c in arrival order, and the last token is a chunk of d
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 4), ("c", 4), ("d", 1)]
    assert out.num_batched_tokens == 10


def test_prefill_and_decode_share_one_step_and_long_prompt_is_chunked():
    s = make(max_num_batched_tokens=8)
    s.add_request(req("short", 3, max_tokens=10))
    s.add_request(req("long", 20))
    log = [[(r.request_id, n) for r, n in step(s).scheduled] for _ in range(4)]
    assert log == [[("short", 3), ("long", 5)],
                   [("short", 1), ("long", 7)],
                   [("short", 1), ("long", 7)],
                   [("short", 1), ("long", 1)]]  # long's prompt is done: both decode


def test_without_chunking_a_prompt_goes_whole_or_waits():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6))
    assert [(r.request_id, n) for r, n in step(s).scheduled] == [("a", 6)]
    assert [(r.request_id, n) for r, n in step(s).scheduled] == [("a", 1), ("b", 6)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.add_request(req("too-long", 11))


def test_max_num_seqs_caps_the_running_batch():
    s = make(max_num_seqs=2)
    for name in "abc":
        s.add_request(req(name, 2, max_tokens=3))
    log = run(s)
    assert max(len(entries) for entries in log) == 2
    assert log[0] == [("a", 2), ("b", 2)]
    assert ("c", 2) in log[3]  # c joins the step after a and b finish


def test_preempt_recompute_takes_the_newest_and_requeues_it_first():
    s = make(num_blocks=4, block_size=4, preemption_mode="recompute")
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    s.add_request(req("later", 1, max_tokens=1))
    step(s)  # both prefill: 2 blocks each, the pool is full
    out = step(s)  # old needs a third block: new is preempted
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("old", 1)]
    new = s.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["new", "later"]
    assert new.output_token_ids == [TOKEN]
    log = run(s)
    # new is recomputed with its generated token: 8 prompt + 1 output in one piece
    assert ("new", 9) in [entry for entries in log for entry in entries]
    assert new.num_preemptions >= 1
    assert s.kv.manager.num_free_blocks == s.kv.num_blocks


def test_preempt_swap_copies_blocks_out_and_back():
    s = make(num_blocks=4, block_size=4, preemption_mode="swap", num_cpu_blocks=4)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    step(s)
    new_blocks = s.kv.manager.block_table("new")
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [gpu for gpu, _ in out.blocks_to_swap_out] == new_blocks[:2]
    new = s.requests["new"]
    assert new.swapped_out and new.num_computed_tokens == 8  # its KV waits on the CPU
    cpu_blocks = [cpu for _, cpu in out.blocks_to_swap_out]
    swapped_in = []
    while s.has_unfinished():
        out = step(s)
        swapped_in += out.blocks_to_swap_in
        if out.blocks_to_swap_in:
            assert ("new", 1) in [(r.request_id, n) for r, n in out.scheduled]  # no recompute
    assert [cpu for cpu, _ in swapped_in] == cpu_blocks
    assert s.kv.swap_pool.num_free == 4 and s.kv.manager.num_free_blocks == 4


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    s = make(num_blocks=4, block_size=4, preemption_mode="swap", num_cpu_blocks=1)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    step(s)
    out = step(s)
    assert out.preempted and not out.blocks_to_swap_out
    assert s.requests["new"].num_computed_tokens == 0 and not s.requests["new"].swapped_out
    run(s)
    assert s.kv.manager.num_free_blocks == 4 and s.kv.swap_pool.num_free == 1


def test_prefix_hit_skips_the_cached_blocks():
    s = make(block_size=4)
    s.add_request(req("first", 10, max_tokens=1, first_token=100))
    run(s)
    second = req("second", 10, max_tokens=1, first_token=100)
    s.add_request(second)
    out = step(s)
    # two full blocks (8 tokens) are cached; only the last 2 prompt tokens are computed
    assert [(r.request_id, n) for r, n in out.scheduled] == [("second", 2)]
    assert (out.num_cached_tokens, out.num_prefix_queries, second.num_cached_tokens) == (8, 10, 8)


@pytest.mark.parametrize("settings, stop", [
    (dict(max_num_batched_tokens=6), "token_budget"),
    (dict(max_num_seqs=1), "max_num_seqs"),
    (dict(num_blocks=2, max_model_len=8), "kv_pool"),
    (dict(max_num_seqs=1, static=True), "max_num_seqs"),
])
def test_the_scheduler_says_why_requests_wait(settings, stop):
    s = make(**{"block_size": 4, **settings})
    s.add_request(req("a", 6, max_tokens=3))
    s.add_request(req("b", 2, max_tokens=3))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert (out.admission_stop, out.num_waiting, out.num_running) == (stop, 1, 1)
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (6, 0)


def test_static_batch_reason_and_decode_count():
    s = make(block_size=4, static=True, max_num_seqs=2)
    for name in "abc":
        s.add_request(req(name, 2, max_tokens=4))
    step(s)
    out = s.schedule()
    assert out.admission_stop == "max_num_seqs" and out.num_decode_tokens == 2
    s.update(out, {r.request_id: [TOKEN] for r, _ in out.scheduled})
    s.abort("b")
    assert s.schedule().admission_stop == "static_batch"  # a room is free, but the batch is not done


def test_static_batch_takes_no_one_until_the_batch_is_done():
    s = make(static=True, max_num_seqs=2)
    s.add_request(req("a", 2, max_tokens=2))
    s.add_request(req("b", 2, max_tokens=6))
    s.add_request(req("c", 2, max_tokens=1))
    log = run(s)
    first_c = next(i for i, entries in enumerate(log) if any(rid == "c" for rid, _ in entries))
    last_b = max(i for i, entries in enumerate(log) if any(rid == "b" for rid, _ in entries))
    assert first_c == last_b + 1  # c waited although a left early
    continuous = make(max_num_seqs=2)
    for name, n in (("a", 2), ("b", 6), ("c", 1)):
        continuous.add_request(req(name, 2, max_tokens=n))
    log = run(continuous)
    assert any(rid == "c" for rid, _ in log[2])  # c takes a's place at once


@pytest.mark.parametrize("stop, expected_reason, expected_len", [
    (dict(ignore_eos=False), "stop", 1),  # the fake model samples EOS
    (dict(stop_token_ids=(EOS,)), "stop", 1),
    (dict(), "length", 5),
])
def test_stop_reasons(stop, expected_reason, expected_len):
    s = make(eos_token_ids=(EOS,))
    request = req("a", 3, max_tokens=5, **{**dict(ignore_eos=True), **stop})
    s.add_request(request)
    run(s, token=lambda r: EOS)
    assert request.finish_reason == expected_reason
    assert request.output_token_ids == [EOS] * expected_len


def test_max_model_len_ends_a_request():
    s = make(max_model_len=6)
    request = req("a", 4, max_tokens=10)
    s.add_request(request)
    run(s)
    assert request.finish_reason == "length" and request.num_tokens == 6


@pytest.mark.parametrize("request_, match", [
    (req("a", 64), "max_model_len"),
    (req("a", 0), "empty"),
])
def test_requests_that_can_never_run_are_rejected_when_added(request_, match):
    s = make(num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=match):
        s.add_request(request_)
    assert not s.has_unfinished()


def test_a_request_id_is_used_once():
    s = make(num_blocks=4, block_size=4)
    s.add_request(req("a", 2))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 2))


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_frees_everything(where):
    s = make(num_blocks=4, block_size=4, preemption_mode="swap", num_cpu_blocks=4)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    if where != "waiting":
        step(s)
    if where == "swapped":
        step(s)
        assert s.requests["new"].swapped_out
    aborted = s.abort("new")
    assert aborted.finish_reason == "abort" and aborted.is_finished
    with pytest.raises(ValueError, match="unknown"):
        s.abort("new")
    run(s)
    assert s.kv.manager.num_free_blocks == 4 and s.kv.swap_pool.num_free == 4


@settings(max_examples=400, deadline=None)
@given(data=st.data(),
       block_size=st.sampled_from([1, 2, 4, 8]),
       budget=st.integers(1, 48),
       max_num_seqs=st.integers(1, 6),
       chunked=st.booleans(),
       prefix_caching=st.booleans(),
       mode=st.sampled_from(["recompute", "swap"]),
       static=st.booleans())
def test_every_request_finishes_with_the_same_tokens_and_every_block_returns(
        data, block_size, budget, max_num_seqs, chunked, prefix_caching, mode, static):
    specs = data.draw(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10),
                                         st.integers(0, 2)), min_size=1, max_size=8))
    longest = max(p + m for p, m, _ in specs)
    if not chunked:
        budget = max(budget, max(p for p, _, _ in specs))
    num_blocks = data.draw(st.integers(-(-longest // block_size), 2 * -(-longest // block_size)))
    s = make(num_blocks, block_size, static, num_cpu_blocks=num_blocks, prefix_caching=prefix_caching,
             max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
             preemption_mode=mode)
    kv = s.kv.manager
    requests = []
    for i, (prompt_len, max_tokens, family) in enumerate(specs):
        requests.append(req(str(i), prompt_len, max_tokens, first_token=100 * family))
        s.add_request(requests[-1])

    def token(r):  # depends on the request and its length only, never on the schedule
        return (int(r.request_id) * 31 + r.num_tokens) % 50 + 10

    computed = {r.request_id: 0 for r in requests}
    num_preemptions = 0
    while s.has_unfinished():
        out = step(s, token)
        num_preemptions += len(out.preempted)
        assert out.scheduled, "no progress"
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= max_num_seqs
        assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled)
        for r, n in out.scheduled:
            computed[r.request_id] += n
        assert sum(computed.values()) < 100_000
    for r in requests:
        assert r.finish_reason == "length"
        expected = [(int(r.request_id) * 31 + r.num_prompt_tokens + k) % 50 + 10
                    for k in range(r.params.max_tokens)]
        assert r.output_token_ids == expected
    assert num_preemptions == sum(r.num_preemptions for r in requests)
    assert kv.num_free_blocks == num_blocks and not s.kv.request_ids
    if s.kv.swap_pool is not None:
        assert s.kv.swap_pool.num_free == num_blocks
