"""The engine (chapters 一次请求的一生 and 调度): the schedule changes when tokens are computed,
never which. Greedy outputs in float64 on the CPU must equal one-request-at-a-time
``minillm.engine.generate`` under preemption (both modes), chunking, prefix hits, static batches and
aborts, and every KV block must return to the pool."""
import copy
import functools
import json
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm import LLM, LLMEngine
from minillm.engine.config import load_config
from minillm.engine.engine_config import cpu_kvcache_bytes
from minillm.engine.loader import load_model
from minillm.engine.planner import plan
from minillm.engine.sampling import SamplingParams
from minillm.lab import records
from minillm.engine.units import GiB
from minillm.lab.metrics import SLO

CONFIG = load_config("tiny").replace(name="tiny-test", num_layers=2, hidden_size=64,
                                     intermediate_size=128, num_heads=4, num_kv_heads=2,
                                     head_dim=16, vocab_size=128)
EOS = CONFIG.eos_token_ids[0]
FAMILIES = [[random.Random(f).randrange(CONFIG.vocab_size) for _ in range(48)] for f in range(3)]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def tiny_model():
    return load_model(CONFIG, device="cpu", dtype=torch.float64, weights="random")


def greedy(max_tokens, ignore_eos=True, stop_token_ids=()):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                          stop_token_ids=stop_token_ids)


@functools.cache
def _reference(prompt: tuple, max_tokens: int, ignore_eos: bool, stop_token_ids: tuple) -> tuple:
    params = greedy(max_tokens, ignore_eos, stop_token_ids)
    return tuple(minillm.generate(tiny_model(), [list(prompt)], params)[0])


def reference(prompt, params):
    """What one request alone gets from the straightforward generator."""
    return list(_reference(tuple(prompt), params.max_tokens, params.ignore_eos, params.stop_token_ids))


def prompt_of(family, length, salt=0):
    """Family 0: fresh random tokens; families 1.. share their first tokens (prefix-cache hits)."""
    if family == 0:
        rng = random.Random(f"{length}-{salt}")
        return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]
    return FAMILIES[family][:length]


def mixed_workload(count=8, seed=0, max_len=40, max_tokens=12):
    rng = random.Random(seed)
    prompts = [prompt_of(rng.randrange(3), rng.randint(1, max_len), salt=i) for i in range(count)]
    params = [greedy(rng.randint(1, max_tokens)) for _ in prompts]
    return prompts, params


def run_and_check(llm, prompts, params):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == reference(prompt, p)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    check_counters(stats, outputs)
    return outputs, stats


def check_counters(stats, outputs):
    """Every run total equals the sum of the steps' decisions it was made from; prompt tokens are
    counted once per request (vLLM's meaning), however often preemption recomputed them."""
    steps = stats["steps"]
    assert stats["num_steps"] == len(steps)
    assert stats["num_preemptions"] == sum(len(s["preempted"]) for s in steps)
    assert stats["prefix_hit_tokens"] == sum(s["num_cached_tokens"] for s in steps)
    assert stats["num_prefill_tokens"] == sum(s["num_prefill_tokens"] for s in steps)
    assert stats["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outputs if o.token_ids)
    assert stats["generation_tokens"] == sum(len(o.token_ids) for o in outputs)
    assert sum(stats[f"num_finished_{r}"] for r in ("stop", "length", "abort")) == len(outputs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_forces_preemption_and_outputs_do_not_change(mode):
    prompts, params = mixed_workload(count=10, seed=1)
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=14, preemption_mode=mode)
    _, stats = run_and_check(llm, prompts, params)
    assert stats["num_preemptions"] > 0
    swapped = sum(s["num_swapped_blocks"] for s in stats["steps"])
    assert (swapped > 0) == (mode == "swap")


def test_small_budget_chunks_prompts_and_outputs_do_not_change():
    prompts, params = mixed_workload(count=6, seed=2)
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=128, max_num_batched_tokens=5,
              enable_prefix_caching=False)
    _, stats = run_and_check(llm, prompts, params)
    assert max(sum(n for _, n in s["scheduled"]) for s in stats["steps"]) <= 5
    long_prompt = next(str(i) for i, p in enumerate(prompts) if len(p) > 5)
    chunks = [n for s in stats["steps"] for rid, n in s["scheduled"] if rid == long_prompt]
    assert chunks[0] < len(prompts[int(long_prompt)])  # its prefill took several steps
    mixed = [s for s in stats["steps"] if s["num_prefill_tokens"] and s["num_decode_tokens"]]
    assert mixed, "no step mixed prefill and decode tokens"


def test_prefix_hits_skip_prefill_and_outputs_do_not_change():
    prompts = [FAMILIES[1][:40], FAMILIES[1][:33], FAMILIES[1][:47] + [5]]
    params = [greedy(6)] * 3
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=64, max_num_seqs=1)
    outputs, stats = run_and_check(llm, prompts, params)
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 40]
    assert stats["prefix_hit_tokens"] == 32 + 40
    assert stats["num_cached_blocks"] > 0


def test_prefix_hit_counts_agree_under_preemption():
    """Requests retried under memory pressure look their prompt up again: the run's counters, the
    steps' decisions and the requests' own counts still agree."""
    prompts = [FAMILIES[1][:24 + i] for i in range(8)]
    params = [greedy(10)] * 8
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=24)
    outputs, stats = run_and_check(llm, prompts, params)
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert sum(o.num_cached_tokens for o in outputs) <= stats["prefix_hit_tokens"]
    record = records.run_record(llm)
    assert sum(r["num_cached_tokens"] for r in record["requests"]) == sum(o.num_cached_tokens for o in outputs)
    assert sum(r["num_preemptions"] for r in record["requests"]) == stats["num_preemptions"]


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_chunking_off_and_static_batches_give_the_same_tokens(scheduling):
    prompts, params = mixed_workload(count=7, seed=3)
    llm = LLM(tiny_model(), block_size=8, num_kv_blocks=64, max_num_seqs=3,
              enable_chunked_prefill=False, max_num_batched_tokens=64, scheduling=scheduling)
    _, stats = run_and_check(llm, prompts, params)
    assert max(s["batch_size"] for s in stats["steps"]) <= 3


@settings(max_examples=500, deadline=None)
@given(data=st.data(),
       block_size=st.sampled_from([1, 2, 4, 8, 16]),
       budget=st.integers(1, 64),
       max_num_seqs=st.integers(1, 8),
       chunked=st.booleans(),
       prefix_caching=st.booleans(),
       mode=st.sampled_from(["recompute", "swap"]),
       scheduling=st.sampled_from(["continuous", "static"]))
def test_greedy_outputs_do_not_depend_on_the_schedule(data, block_size, budget, max_num_seqs,
                                                      chunked, prefix_caching, mode, scheduling):
    specs = data.draw(st.lists(st.tuples(
        st.integers(0, 2),  # prompt family (1, 2 share prefixes)
        st.integers(1, 40),  # prompt length
        st.integers(1, 10),  # max_tokens
        st.booleans(),  # ignore_eos
        st.one_of(st.none(), st.integers(0, 9)),  # stop at the token the free run makes here
        st.one_of(st.none(), st.integers(0, 30)),  # abort at this step
    ), min_size=1, max_size=7))
    prompts = [prompt_of(f, n, salt=i) for i, (f, n, *_) in enumerate(specs)]
    params = []
    for prompt, (_, _, max_tokens, ignore_eos, stop_at, _) in zip(prompts, specs):
        free_run = reference(prompt, greedy(max_tokens))
        stop = () if stop_at is None else (free_run[min(stop_at, len(free_run) - 1)],)
        params.append(greedy(max_tokens, ignore_eos, stop))
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    min_blocks = -(-longest // block_size)
    num_blocks = data.draw(st.integers(min_blocks, 2 * min_blocks))
    if not chunked:
        budget = max(budget, max(map(len, prompts)))
    engine = LLMEngine(tiny_model(), block_size=block_size, num_kv_blocks=num_blocks,
                       max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                       enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching,
                       preemption_mode=mode, scheduling=scheduling)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(i, prompt, p)
    abort_at = {str(i): spec[-1] for i, spec in enumerate(specs) if spec[-1] is not None}
    streamed = {str(i): [] for i in range(len(prompts))}
    final = {}
    step = 0
    while engine.has_unfinished():
        for request_id, when in abort_at.items():
            if when == step and request_id not in final and request_id in engine.scheduler.requests:
                engine.abort(request_id)
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
        step += 1
    assert sorted(final) == sorted(streamed)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        out = final[str(i)]
        expected = reference(prompt, p)
        assert streamed[str(i)] == out.token_ids
        if out.finish_reason == "abort":
            assert out.token_ids == expected[:len(out.token_ids)]
        else:
            assert out.token_ids == expected
            stopped = expected[-1] in p.stop_token_ids or (expected[-1] == EOS and not p.ignore_eos)
            assert out.finish_reason == ("stop" if stopped else "length")
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"] == num_blocks
    assert stats["num_running"] == stats["num_waiting"] == 0
    check_counters(stats, list(final.values()))


def test_streaming_and_timestamps():
    engine = LLMEngine(tiny_model(), block_size=4, num_kv_blocks=64)
    engine.add_request("a", FAMILIES[0][:9], greedy(5))
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.new_token_ids)
            final = out
    assert deltas == [[t] for t in final.token_ids]
    m = final.metrics
    assert m.arrival_time <= m.tokenized_time <= m.first_scheduled_time <= m.first_token_time
    assert m.token_times == sorted(m.token_times) and len(m.token_times) == 5
    assert m.first_token_time == m.token_times[0] and m.finish_time == m.token_times[-1]
    assert m.ttft == m.first_token_time - m.arrival_time
    assert m.tpot == pytest.approx((m.e2e - m.ttft) / 4)
    assert m.queueing == m.first_scheduled_time - m.arrival_time


def test_stop_reasons_and_max_model_len():
    prompt = FAMILIES[2][:6]
    free_run = reference(prompt, greedy(8))
    stop_at = free_run[3]
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=64, max_model_len=12)
    outs = llm.generate([prompt, prompt, prompt],
                        [greedy(8, stop_token_ids=(stop_at,)), greedy(3), greedy(20)], use_tqdm=False)
    first_stop = free_run.index(stop_at)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids == free_run[:first_stop + 1]
    assert outs[1].finish_reason == "length" and outs[1].token_ids == free_run[:3]
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 12 - 6
    assert outs[0].text is None  # no tokenizer


def test_abort_returns_blocks_and_reports_abort():
    engine = LLMEngine(tiny_model(), block_size=4, num_kv_blocks=32, max_num_seqs=2)
    engine.add_request("keep", FAMILIES[0][:10], greedy(6))
    engine.add_request("drop", FAMILIES[1][:10], greedy(6))
    engine.add_request("never-ran", FAMILIES[2][:10], greedy(6))
    engine.step()
    engine.abort("drop")
    engine.abort("never-ran")
    with pytest.raises(ValueError, match="unknown"):
        engine.abort("drop")
    final = {}
    while engine.has_unfinished():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert final["drop"].finish_reason == final["never-ran"].finish_reason == "abort"
    assert final["never-ran"].token_ids == []
    assert final["keep"].token_ids == reference(FAMILIES[0][:10], greedy(6))
    assert engine.stats()["num_free_blocks"] == 32


@pytest.mark.parametrize("prompt, match", [
    ([], "empty"),
    ([1, 2, CONFIG.vocab_size], "token ids must be in"),
    ([1, True], "token ids must be ints"),
    (list(range(64)), "max_model_len"),
    ("hello", "no tokenizer"),
])
def test_bad_requests_are_rejected_and_leave_nothing_behind(prompt, match):
    engine = LLMEngine(tiny_model(), block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, greedy(4))
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("y", [1, 2], {"max_tokens": 3})


@pytest.mark.parametrize("kwargs, match", [
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(scheduling="fifo"), "scheduling"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
])
def test_bad_settings_fail_before_the_model_is_loaded(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("no-such-model-is-loaded", **kwargs)


def test_pool_and_max_model_len_must_agree():
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_model(), block_size=4, num_kv_blocks=4, max_model_len=17)
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=4)
    assert llm.config.max_model_len == 16


def test_generate_checks_params_and_arrivals():
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match="params"):
        llm.generate([[1], [2]], [greedy(2)], use_tqdm=False)
    with pytest.raises(ValueError, match="arrival_times"):
        llm.generate([[1], [2]], greedy(2), use_tqdm=False, arrival_times=[0.0])


def test_online_replay_adds_requests_at_their_arrival_times():
    prompts, params = mixed_workload(count=4, seed=5)
    offsets = [0.0, 0.02, 0.04, 0.3]
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=64)
    outputs = llm.generate(prompts, params, use_tqdm=False, arrival_times=offsets)
    start = outputs[0].metrics.arrival_time
    for out, offset, prompt, p in zip(outputs, offsets, prompts, params):
        assert out.metrics.arrival_time - start == pytest.approx(offset)
        assert out.metrics.first_scheduled_time >= out.metrics.arrival_time
        assert out.token_ids == reference(prompt, p)
    assert len(llm.stats()["steps"]) >= 2


def test_stats_and_run_record(tmp_path):
    prompts, params = mixed_workload(count=5, seed=6)
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=20)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    for key in ("num_kv_blocks", "num_free_blocks", "num_cached_blocks", "num_preemptions",
                "prefix_hit_tokens", "steps"):
        assert key in stats
    steps = stats["steps"]
    assert sum(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps) == \
        sum(n for s in steps for _, n in s["scheduled"])
    assert all(s["batch_size"] == len(s["scheduled"]) and s["start"] <= s["end"] for s in steps)
    path = records.save_run(llm, tmp_path / "run.json", slo=SLO(ttft=10.0, tpot=10.0))
    record = json.loads(path.read_text())
    assert record["format"] == "minillm-run-metrics"
    assert record["model"]["num_layers"] == 2 and record["engine"]["num_kv_blocks"] == 20
    assert len(record["requests"]) == 5
    assert record["summary"]["output_tokens"] == sum(p.max_tokens for p in params)
    assert record["memory"]["kv_cache_bytes"] == 20 * 4 * 2 * 2 * CONFIG.kv_size * 8
    # a new generate() starts a new run
    llm.generate(prompts[:1], params[:1], use_tqdm=False)
    assert len(records.run_record(llm)["requests"]) == 1


def test_the_planner_sizes_the_pool_when_num_kv_blocks_is_none():
    llm = LLM(tiny_model(), block_size=16, memory_limit="64MiB", max_num_batched_tokens=256,
              max_model_len=512)
    expected = plan(tiny_model(), block_size=16, memory_limit="64MiB", max_num_batched_tokens=256,
                    max_model_len=512)
    assert llm.stats()["num_kv_blocks"] == expected.num_blocks
    assert llm.config.max_model_len == 512
    prompts, params = mixed_workload(count=3, seed=7)
    run_and_check(llm, prompts, params)


def test_the_cpu_pool_is_sized_like_vllms_cpu_backend(monkeypatch, caplog):
    """No sizing argument on the CPU: $MINILLM_CPU_KVCACHE_SPACE GiB of blocks, at most
    max_num_seqs requests of max_model_len, said in the log."""
    from minillm.engine.engine import logger

    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setenv("MINILLM_CPU_KVCACHE_SPACE", "0.01")
    bytes_per_block = 16 * 2 * CONFIG.num_layers * CONFIG.kv_size * 8  # float64
    with caplog.at_level("INFO", logger="minillm.engine"):
        llm = LLM(tiny_model())
    assert llm.config.num_kv_blocks == round(0.01 * GiB) // bytes_per_block
    assert llm.config.max_model_len == llm.config.num_kv_blocks * 16
    assert llm.memory_plan is None
    [line] = {r.getMessage() for r in caplog.records if r.name == "minillm.engine"}
    assert f"KV cache on the CPU: {llm.config.num_kv_blocks} blocks of 16 tokens" in line
    assert "MINILLM_CPU_KVCACHE_SPACE=10.24 MiB" in line
    capped = LLM(tiny_model(), max_num_seqs=2, max_model_len=100)
    assert capped.config.num_kv_blocks == 2 * 7 and capped.config.max_model_len == 100
    prompts, params = mixed_workload(count=3, seed=8)
    run_and_check(capped, prompts, params)


def test_the_cpu_pool_defaults_to_4_gib_and_a_bad_size_fails_before_loading(monkeypatch):
    monkeypatch.delenv("MINILLM_CPU_KVCACHE_SPACE", raising=False)
    assert cpu_kvcache_bytes() == 4 * GiB
    monkeypatch.setenv("MINILLM_CPU_KVCACHE_SPACE", "0.5")
    assert cpu_kvcache_bytes() == GiB // 2
    for bad in ("0", "-1", "lots", "nan", "inf"):
        monkeypatch.setenv("MINILLM_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="MINILLM_CPU_KVCACHE_SPACE must be a positive number"):
            LLM("no-such-model-is-loaded", device="cpu")
    LLM(tiny_model(), num_kv_blocks=8)  # a given pool size does not read it


def test_padded_decode_graphs_give_the_same_tokens():
    """Off CUDA a decode graph runs eagerly on its padded buffers: the padding logic is the GPU's."""
    from minillm.engine.decode_graph import DecodeGraph, graph_sizes

    prompts, params = mixed_workload(count=11, seed=8)
    eager = LLM(tiny_model(), block_size=4, num_kv_blocks=256, enforce_eager=True)
    padded = LLM(tiny_model(), block_size=4, num_kv_blocks=256, cuda_graph_sizes=(1, 2, 4, 8))
    runs = Counter()
    run = DecodeGraph.run

    def counted(graph, input_ids, positions, attn):
        runs[graph.size, len(input_ids)] += 1
        return run(graph, input_ids, positions, attn)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeGraph, "run", counted)
        expected = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        assert [o.token_ids for o in padded.generate(prompts, params, use_tqdm=False)] == expected
    assert runs and all(size >= batch and size in (1, 2, 4, 8) for size, batch in runs)
    assert any(size > batch for size, batch in runs)  # some steps were padded
    assert not LLM(tiny_model(), block_size=4, num_kv_blocks=16).runner.decode_graphs.sizes  # CPU default
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20] and graph_sizes(1) == [1]


def test_a_compiled_decode_step_gives_the_eager_steps_tokens_and_compiles_once(monkeypatch):
    """compile_decode: every decode step of one sequence runs the compiled graph, whose context
    length is dynamic (blocks of 4 tokens: the tables widen every few steps and nothing recompiles);
    steps of several sequences and prompts stay eager; the tokens are the eager engine's (float64,
    where only the order of additions could differ)."""
    from minillm.engine.decode_graph import CompiledDecode

    prompts, params = mixed_workload(count=5, seed=3, max_tokens=30)
    prompts, params = prompts + [[7]], params + [greedy(5)]  # a one-token prompt: a first context of 2
    eager = LLM(tiny_model(), block_size=4, num_kv_blocks=256, enforce_eager=True)
    compiled = LLM(tiny_model(), block_size=4, num_kv_blocks=256, compile_decode=True)
    runs, logits = Counter(), []
    run, output_layer = CompiledDecode.run, CompiledDecode.logits

    def counted(step, input_ids, positions, attn):
        runs[attn.max_seq_len] += 1
        return run(step, input_ids, positions, attn)

    def counted_logits(step, hidden):
        logits.append(len(hidden))
        return output_layer(step, hidden)

    monkeypatch.setattr(CompiledDecode, "run", counted)
    monkeypatch.setattr(CompiledDecode, "logits", counted_logits)
    expected = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        one_at_a_time = [o.token_ids for prompt, p in zip(prompts, params)
                         for o in compiled.generate([prompt], [p], use_tqdm=False)]
    assert one_at_a_time == expected
    assert sum(runs.values()) == sum(max(0, p.max_tokens - 1) for p in params)  # each decode step
    assert logits == [1] * sum(p.max_tokens for p in params)  # and each prompt's last row
    assert max(runs) > 4 * 8 and min(runs) == 2  # contexts of many blocks, and one of two tokens
    together = compiled.generate(prompts, params, use_tqdm=False)  # batched steps: eager
    assert [o.token_ids for o in together] == expected


def test_a_compiled_int8_output_layer_reads_its_rows_in_float32():
    """Compiled, an int8 layer's one-row product is a fused loop over the int8 rows with float32
    activations: the output layer's logits are the float64 product of its dequantized weights to
    float32 rounding, where torch's eager kernel rounds the activations to bf16. The int8 engine's
    compiled steps give the float64 engine's greedy tokens (its prompts run eagerly in both), with
    another model's compiled engine in the same process (each runs its own graphs, unguarded)."""
    model = load_model(CONFIG, device="cpu", dtype=torch.float32, weights="random", quantization="int8")
    compiled = LLM(model, block_size=4, num_kv_blocks=64, quantization="int8", compile_decode=True)
    other = LLM(tiny_model(), block_size=4, num_kv_blocks=64, compile_decode=True)
    exact = LLM(copy.deepcopy(model).to(torch.float64), block_size=4, num_kv_blocks=64, quantization="int8")
    hidden = torch.randn(1, CONFIG.hidden_size, generator=torch.Generator().manual_seed(0))
    product = hidden.double() @ model.lm_head.dequantized().double().t()
    with torch.inference_mode():
        errors = [(logits.double() - product).abs().max() / product.abs().max()
                  for logits in (compiled.runner.compiled_decode.logits(hidden), model.compute_logits(hidden))]
    assert errors[0] < 1e-6 < 1e-4 < errors[1]
    prompts, _ = mixed_workload(count=5, seed=3)
    params = greedy(30)
    assert ([o.token_ids for p in prompts for o in compiled.generate([p], params, use_tqdm=False)]
            == [o.token_ids for o in exact.generate(prompts, params, use_tqdm=False)])
    assert ([o.token_ids for p in prompts for o in other.generate([p], params, use_tqdm=False)]
            == [reference(p, params) for p in prompts])


def test_compile_decode_refuses_what_it_cannot_compile():
    with pytest.raises(ValueError, match="fp8 KV cache"):
        LLM(tiny_model(), num_kv_blocks=16, kv_cache_dtype="fp8", compile_decode=True)
    with pytest.raises(ValueError, match="compile_decode must be a bool"):
        LLM(tiny_model(), num_kv_blocks=16, compile_decode="yes")


def test_a_padded_decode_graph_cuts_long_contexts_as_the_eager_step(monkeypatch):
    """A decode graph's inputs (the widest block table, padding rows) through the Triton kernels,
    run here by Triton's interpreter on an H100's SM count: the real rows' hidden states are the
    eager step's. Cut by the table's width, contexts of ~1k tokens would be one piece, not four,
    and their attention would round differently (a float32 kernel in a float64 model)."""
    from minillm.engine import model as model_module
    from minillm.engine.kernels import triton_attention

    if not triton_attention.INTERPRET:
        pytest.skip("the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 only")
    monkeypatch.setattr(model_module, "default_backend", lambda x: "triton")
    monkeypatch.setattr(triton_attention, "_multiprocessor_count", lambda device: 132)
    model = load_model(CONFIG.replace(num_layers=1), device="cpu", dtype=torch.float64, weights="random")
    llm = LLM(model, block_size=16, num_kv_blocks=400, cuda_graph_sizes=(8,))
    cache, contexts = llm.kv_cache, [1000, 1100, 700, 300, 1]
    cache.kv.normal_(generator=torch.Generator().manual_seed(0))  # a cached context for everyone
    for i, ctx in enumerate(contexts):
        assert cache.allocate(str(i), ctx)
    batch = [(str(i), ctx - 1, 1) for i, ctx in enumerate(contexts)]
    input_ids, positions, attn = cache.prepare_inputs(batch, [i + 1 for i in range(len(contexts))])
    assert attn.block_tables.shape[1] == 69  # the eager step's table: as wide as its longest context
    with torch.inference_mode():
        eager = model(input_ids, positions, attn, cache.layer_caches)
        graph = llm.runner.decode_graphs.run(input_ids, positions, attn)
    assert llm.runner.decode_graphs.graphs[8].attn.block_tables.shape == (8, 400)  # the whole pool
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-12)


def test_min_tokens_runs_greedy_past_the_eos_it_would_stop_at():
    """The first token the model would stop at becomes its EOS: without min_tokens the answer
    ends there; with it the EOS is masked until min_tokens are out, as in the reference generator."""
    prompt = FAMILIES[2][:12]
    free = LLM(tiny_model(), block_size=4, num_kv_blocks=32).generate(
        [prompt], greedy(12), use_tqdm=False)[0].token_ids
    stop_at = next(i for i, t in enumerate(free) if i >= 1 and t not in free[:i])
    eos_model = load_model(CONFIG.replace(eos_token_ids=(free[stop_at],)), device="cpu",
                           dtype=torch.float64, weights="random")
    llm = LLM(eos_model, block_size=4, num_kv_blocks=32)
    stopped, long = llm.generate([prompt, prompt], [greedy(12, ignore_eos=False),
                                 SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8)],
                                 use_tqdm=False)
    assert stopped.token_ids == free[:stop_at + 1] and stopped.finish_reason == "stop"
    assert len(long.token_ids) >= 8 and free[stop_at] not in long.token_ids[:8]
    assert long.token_ids[:stop_at] == free[:stop_at]
    assert long.token_ids == minillm.generate(eos_model, [prompt], SamplingParams(
        temperature=0.0, max_tokens=12, min_tokens=8))[0]


def test_the_snapshot_counts_from_the_start_and_a_run_is_a_window_on_it():
    """Two runs: the snapshot's totals hold both, stats() only the second, and reading either
    resets nothing; with log_limit the step log keeps only the latest steps."""
    prompts, params = mixed_workload(count=4, seed=8)
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=64, log_limit=3)
    first = llm.generate(prompts, params, use_tqdm=False)
    after_first = llm.snapshot()
    second = llm.generate(prompts[:2], params[:2], use_tqdm=False)
    total, run = llm.snapshot(), llm.stats()
    assert llm.snapshot() == total  # reading changes nothing
    for name in ("num_steps", "prompt_tokens", "generation_tokens", "num_prefill_tokens",
                 "prefix_hit_tokens", "num_finished_length"):
        assert total[name] == after_first[name] + run[name], name
    assert run["generation_tokens"] == sum(len(o.token_ids) for o in second)
    assert total["generation_tokens"] == sum(len(o.token_ids) for o in first + second)
    assert total["num_running"] == total["num_waiting"] == 0 and total["kv_usage"] == 0
    assert len(run["steps"]) == min(3, run["num_steps"])
    assert run["steps"][-1]["step"] == run["num_steps"] - 1
