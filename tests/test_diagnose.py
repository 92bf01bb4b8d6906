"""The diagnosis (chapter 先问瓶颈，再换框架): records of three runs of the engine on a tiny model,
each built to hit one wall, must be told apart; the ledger and the batch numbers must match what
the engine did; bad records get a ValueError (and exit code 2 on the command line) naming what
is wrong."""
import argparse
import copy
import functools
import json

import pytest
import torch

from minillm import LLM
from minillm.engine.config import load_config
from minillm.engine.loader import load_model
from minillm.engine.sampling import SamplingParams
from minillm.lab import estimate as ledger
from minillm.lab import records
from minillm.lab.diagnose import SYMPTOMS, WALLS, _step_ledgers, add_cli, diagnose
from minillm.lab.workload import make_workload

CONFIG = load_config("tiny").replace(name="tiny-diagnose", num_layers=2, hidden_size=64,
                                     intermediate_size=128, num_heads=4, num_kv_heads=2,
                                     head_dim=16, vocab_size=256)
# name: (prompt lengths, output lengths, engine settings); each run takes well under a second
SCENARIOS = {
    "long_prompts": ([1500] * 4, [2] * 4, dict(num_kv_blocks=512, max_num_batched_tokens=2048)),
    "many_decodes": ([8] * 32, [64] * 32, dict(num_kv_blocks=512)),
    "small_pool": ([48] * 24, [48] * 24, dict(num_kv_blocks=16, max_model_len=256)),
}
EXPECTED = {"long_prompts": ("compute", "first_token"), "many_decodes": ("bandwidth", "tokens"),
            "small_pool": ("capacity", "first_token")}


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def tiny_model():
    return load_model(CONFIG, device="cpu", dtype=torch.float32, weights="random")


def run_engine(input_lens, output_lens, **settings) -> LLM:
    llm = LLM(tiny_model(), enable_prefix_caching=False, **settings)
    make_workload("test", input_lens, output_lens, CONFIG.vocab_size).run(llm)
    return llm


@functools.cache
def scenario_record(name: str) -> dict:
    input_lens, output_lens, settings = SCENARIOS[name]
    return records.run_record(run_engine(input_lens, output_lens, **settings))


def record_of(name: str) -> dict:
    return copy.deepcopy(scenario_record(name))


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_scenario_names_its_wall_and_symptom(name):
    result = diagnose(record_of(name))
    assert (result.wall, result.symptom) == EXPECTED[name]
    assert result.wall in WALLS and result.symptom in SYMPTOMS
    report = result.report()
    assert f"Wall: {result.wall}" in report
    assert result.evidence and all(line in report for line in result.evidence)


def test_the_ledger_matches_the_estimate_and_the_pool():
    record = record_of("small_pool")
    memory = diagnose(record).memory
    assert memory.weight_bytes == memory.weight_bytes_estimate == ledger.weight_bytes(CONFIG, "fp32")
    assert memory.kv_bytes_per_token == memory.kv_bytes_per_token_estimate == ledger.kv_bytes_per_token(CONFIG, "fp32")
    assert memory.kv_pool_tokens == 16 * record["engine"]["block_size"]
    assert memory.peak_kv_tokens == memory.kv_pool_tokens  # a small pool fills up
    assert memory.mean_request_tokens == 48 + 48
    assert memory.plan is None  # the pool was sized by hand: no card in the record


def test_a_planned_pool_reports_the_card_and_its_headroom():
    llm = LLM(tiny_model(), num_kv_blocks=None, memory_limit="16MiB", max_num_batched_tokens=256,
              enable_prefix_caching=False)
    make_workload("planned", [32] * 4, [4] * 4, CONFIG.vocab_size).run(llm)
    result = diagnose(records.run_record(llm))
    assert result.memory.plan == llm.memory_plan and llm.memory_plan.total_bytes == 16 * 2**20
    assert f"unused {ledger.fmt_bytes(llm.memory_plan.unused_bytes)}" in result.report()


def test_batches_and_queueing_come_from_the_step_log():
    many = diagnose(record_of("many_decodes")).batching
    # 32 short prompts fit one step; then 63 decode steps of all 32 requests
    assert many.num_steps == 64 and many.max_batch == 32 and many.mean_decode_batch == 32
    assert sum(many.waited_steps.values()) == 0
    long_prompts = diagnose(record_of("long_prompts")).batching
    assert long_prompts.waited_steps["token_budget"] >= 1 and long_prompts.waited_steps["kv_pool"] == 0
    small = diagnose(record_of("small_pool"))
    assert small.latency.num_preemptions > 0 and small.batching.waited_steps["kv_pool"] > 0
    assert 0 < small.batching.queueing_share_of_ttft <= 1


def test_prompt_flops_and_decode_bytes_follow_the_ledger():
    """With every step lasting one second, the rates are the ledger's FLOPs and bytes per step."""
    record = record_of("many_decodes")
    for i, step in enumerate(record["stats"]["steps"]):
        step["start"], step["end"] = float(i), float(i + 1)
    batching = diagnose(record, bandwidth=1e9, peak_flops=1e12).batching
    prompt = ledger.prefill(CONFIG, 8)
    assert batching.prefill_flops_per_s == pytest.approx(32 * prompt.flops)
    # decode steps 1..63 read contexts of 9..71 tokens (prompt 8 + outputs) for all 32 requests
    kv_tokens = 32 * sum(range(9, 72)) / 63
    # the matmul weights (the input embedding is a lookup, not a read of the table)
    weights = 4 * ledger.matmul_param_count(CONFIG)
    assert weights == ledger.weight_bytes(CONFIG, "fp32") - 4 * (CONFIG.vocab_size * CONFIG.hidden_size
                                                                  + ledger.param_breakdown(CONFIG)["norms"])
    expected_bytes = weights + kv_tokens * ledger.kv_bytes_per_token(CONFIG, "fp32")
    assert batching.decode_bytes_per_s == pytest.approx(expected_bytes)
    assert batching.mbu == pytest.approx(expected_bytes / 1e9)
    assert batching.mfu == pytest.approx(32 * prompt.flops / 1e12)


def test_the_wall_follows_where_the_busy_time_went():
    """Without ceilings: the same schedule, its prompt step made to last longer than all decode
    steps, is the compute wall, and the evidence says the prompt steps stood in."""
    record = record_of("many_decodes")
    first = record["stats"]["steps"][0]
    first["end"] = first["start"] + 10 * sum(s["end"] - s["start"] for s in record["stats"]["steps"])
    result = diagnose(record)
    assert result.wall == "compute" and result.batching.prefill_time_share > 0.9
    assert result.batching.compute_bound_share is None and "stand in" in result.evidence[0]


def test_the_wall_follows_the_roofline_of_each_step():
    """With ceilings, each step's floor max(F/P, M/W) decides its side: 32 decodes of the tiny
    model in fp32 do about 16 FLOP per byte (2 FLOPs per 4-byte weight for each of 32 tokens) and
    the prompt step about 128: under a ridge of 30 FLOP/byte only the prompt step is compute-bound,
    under a ridge of 1 every step is; the wall follows."""
    record = record_of("many_decodes")
    for i, step in enumerate(record["stats"]["steps"]):
        step["start"], step["end"] = float(i), float(i + 1)
    high_ridge = diagnose(record, bandwidth=1e9, peak_flops=3e10)
    assert high_ridge.batching.compute_bound_share == pytest.approx(1 / 64)  # only the prompt step
    assert high_ridge.wall == "bandwidth"
    low_ridge = diagnose(record, bandwidth=1e9, peak_flops=1e9)
    assert low_ridge.batching.compute_bound_share == 1.0 and low_ridge.wall == "compute"


def test_preemption_is_not_failure():
    small = diagnose(record_of("small_pool"))
    assert small.latency.num_preemptions > 0 and small.latency.num_aborted == 0
    assert small.symptom != "failure" and small.wall == "capacity"


def test_an_aborted_request_is_a_failure():
    llm = LLM(tiny_model(), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.add_request("kept", [1, 2, 3], params)
    llm.add_request("dropped", [4, 5, 6], params)
    llm.step()
    llm.abort("dropped")
    while llm.has_unfinished():
        llm.step()
    result = diagnose(records.run_record(llm))
    assert result.symptom == "failure" and result.latency.num_aborted == 1
    assert result.wall in WALLS


def test_a_saved_record_reads_the_same_and_the_cli_prints_it(tmp_path, capsys):
    llm = run_engine(*SCENARIOS["small_pool"][:2], **SCENARIOS["small_pool"][2])
    path = records.save_run(llm, tmp_path / "run.json")
    assert diagnose(path).as_dict() == diagnose(json.loads(path.read_text())).as_dict()
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["diagnose", str(path)])
    assert args.func(args) == 0
    assert "Wall: capacity" in capsys.readouterr().out
    args = parser.parse_args(["diagnose", str(path), "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["wall"] == "capacity"


def _drop(path: str):
    """A record with the field at dotted ``path`` removed."""
    def change(record):
        *parents, last = path.split(".")
        node = record
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[last]
    return change


@pytest.mark.parametrize("change,message", [
    (_drop("engine.block_size"), "missing engine.block_size"),
    (_drop("stats.steps"), "missing stats.steps"),
    (_drop("memory"), "missing memory"),
    (_drop("requests.0.ttft"), r"missing requests\[0\].ttft"),
    (lambda r: r.update(format="something-else"), "not a minillm run record"),
    (lambda r: r.update(requests=[]), "no finished requests"),
    (lambda r: r["model"].update(layers=3), "model section is not a ModelConfig"),
])
def test_incomplete_records_name_what_is_missing(change, message):
    record = record_of("many_decodes")
    change(record)
    with pytest.raises(ValueError, match=message):
        diagnose(record)


def test_unreadable_records_and_the_cli_exit_code(tmp_path, capsys):
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["diagnose", str(garbage)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                   "prompt_lookup_min": 1},
                                  {"method": "draft_layers", "num_draft_layers": 1, "num_speculative_tokens": 3}])
def test_speculation_bills_every_computed_position_and_the_drafts(spec):
    """One request decoding a repetitive prompt, every step made to last one second: each decode
    step's bytes are the weights for its tokens and the KV of its true context (prompt + tokens
    output so far, the rejected proposals not kept) plus the positions it computed. A draft of the first layer adds, per pass j, that layer's
    and the output layer's weights and that layer's KV. The report names the rejected share."""
    prompt = [5, 9, 2, 7, 1, 3] * 4
    llm = LLM(tiny_model(), num_kv_blocks=64, speculative_config=spec)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    record = records.run_record(llm)
    steps = record["stats"]["steps"]
    for i, step in enumerate(steps):
        step["start"], step["end"] = float(i), float(i + 1)
    batching = diagnose(record, bandwidth=1e9, peak_flops=1e12).batching
    kv = ledger.kv_bytes_per_token(CONFIG, "fp32")
    draft = CONFIG.replace(num_layers=1)
    expected, generated = [], steps[0]["num_generated"]
    for step in steps[1:]:  # the decode and verify steps
        ((_, num_new),) = step["scheduled"]
        before = len(prompt) + generated - 1
        nbytes = ledger.matmul_weight_bytes(CONFIG, num_new, "fp32") + (before + num_new) * kv
        if spec["method"] == "draft_layers":
            nbytes += sum(ledger.matmul_weight_bytes(draft, 1, "fp32") + (before + j + 1) * kv / 2
                          for j in range(num_new - 1))
        expected.append(nbytes)
        generated += step["num_generated"]
    assert batching.decode_bytes_per_s == pytest.approx(sum(expected) / len(expected))
    rejected = record["stats"]["num_draft_tokens"] - record["stats"]["num_accepted_tokens"]
    assert batching.num_rejected_positions == rejected > 0
    assert batching.num_computed_positions == len(prompt) + 40 - 1 + rejected
    assert batching.rejected_share == rejected / batching.num_computed_positions
    assert f"{rejected:,} of {batching.num_computed_positions:,} computed positions rejected" in \
        diagnose(record).report()


def test_draft_passes_start_from_each_requests_context_before_the_step():
    """Two requests, a draft of the first layer: a prefills 10 tokens and b 6; then a verifies 3
    proposals (2 rejected) while b decodes one; then a verifies 2 (1 rejected). The third step's
    draft passes start from a's context before it, 10 + 4 - 2 = 12, and bill only a."""
    kv = ledger.kv_bytes_per_token(CONFIG, "fp32")
    step = lambda scheduled, rejected: {"scheduled": scheduled, "preempted": [], "num_sampled": len(scheduled),
                                        "num_draft_tokens": sum(n - 1 for r, n in scheduled if r in rejected),
                                        "num_rejected": rejected}
    record = {"engine": {"block_size": 16, "preemption_mode": "recompute",
                         "speculative_config": {"method": "draft_layers", "num_draft_layers": 1}},
              "memory": {"kv_bytes_per_block": 16 * kv}, "dtype": "fp32",
              "stats": {"steps": [step([["a", 10], ["b", 6]], {}), step([["a", 4], ["b", 1]], {"a": 2}),
                                  step([["a", 3]], {"a": 1})]}}
    without = copy.deepcopy(record)
    without["engine"]["speculative_config"] = None
    draft = CONFIG.replace(num_layers=1)
    _, (f2, b2), (f3, b3) = _step_ledgers(record, CONFIG)
    _, (g2, c2), (g3, c3) = _step_ledgers(without, CONFIG)
    passes = [(1, 12 + 1), (1, 12 + 2)]  # (rows, a's positions) of passes 0 and 1
    assert f3 - g3 == sum(rows * ledger.matmul_flops_per_token(draft) + ledger.attention_flops_per_token(draft, ctx)
                          for rows, ctx in passes)
    assert b3 - c3 == pytest.approx(sum(ledger.matmul_weight_bytes(draft, rows, "fp32") + ctx * kv / 2
                                        for rows, ctx in passes))
    # the step before: a's context 10, three passes
    assert b2 - c2 == pytest.approx(sum(ledger.matmul_weight_bytes(draft, 1, "fp32") + (10 + j + 1) * kv / 2
                                        for j in range(3)))
    assert f2 - g2 == sum(ledger.matmul_flops_per_token(draft) + ledger.attention_flops_per_token(draft, 10 + j + 1)
                          for j in range(3))


# --- The chapter's lab and page ------------------------------------------------------------------

@functools.cache
def lab_model():
    """The lab's model on the CPU: the tiny preset, random weights."""
    return load_model("tiny", device="cpu", dtype=torch.float32, weights="random")


def lab_record(lengths, output, pool_tokens=None) -> dict:
    """The run record of a scenario of the lab at its CPU size (budget 512, blocks of 16)."""
    from minillm.lab.notebook import room

    blocks = ledger.ceil_div(pool_tokens or room(lengths, output, 16), 16)
    llm = LLM(lab_model(), block_size=16, num_kv_blocks=blocks, max_num_batched_tokens=512,
              enable_prefix_caching=False)
    make_workload("lab", lengths, [output] * len(lengths), lab_model().config.vocab_size).run(llm)
    return records.run_record(llm)


def lab_scenario(lengths, output, pool_tokens=None):
    """A scenario of the lab at its CPU size, diagnosed."""
    return diagnose(lab_record(lengths, output, pool_tokens), bandwidth=1e10, peak_flops=1e11)


def test_the_labs_scenarios_schedule_as_the_chapter_says():
    """What the chapter's claims rest on, by the scheduler's rules alone: the long prompts wait for
    the token budget, never for KV, and some of their few decodes ride in a later document's
    prefill chunk; four decodes run together for all their steps; twelve requests in a pool of
    three wait for KV blocks and all finish; a pool that holds them all ends the waiting and the
    preemptions and makes the decode batch larger."""
    long_record = lab_record([2048] * 3, 4)
    long_run = diagnose(long_record, bandwidth=1e10, peak_flops=1e11)
    assert long_run.batching.waited_steps["token_budget"] > 0 and long_run.batching.waited_steps["kv_pool"] == 0
    steps = long_record["stats"]["steps"]
    assert any(s["num_prefill_tokens"] and s["num_decode_tokens"] for s in steps)
    heavy = lab_scenario([32] * 4, 64)
    assert heavy.batching.num_steps == 64 and heavy.batching.mean_decode_batch == 4
    assert sum(heavy.batching.waited_steps.values()) == 0
    small = lab_scenario([256] * 12, 32, 3 * (256 + 32))
    assert small.wall == "capacity" and small.batching.waited_steps["kv_pool"] > 0
    assert small.latency.num_aborted == 0 and small.symptom != "failure"
    assert small.memory.kv_pool_tokens == 864 and small.memory.requests_in_pool < 12
    roomy = lab_scenario([256] * 12, 32)
    assert roomy.batching.waited_steps["kv_pool"] == 0 and roomy.latency.num_preemptions == 0
    assert roomy.batching.mean_decode_batch > small.batching.mean_decode_batch


def test_four_tiny_decodes_stay_under_a_cpus_ridge():
    """The lab's decode-heavy scenario on the CPU: four tiny fp32 decodes do under 2 FLOP per byte;
    the GPU's batch of 128 would do over 25, more than ten times as many (the page: "`tiny` 的解码批一大就会越过它")."""
    cfg = load_config("tiny")
    four, gpus_batch = (ledger.decode_step(cfg, b, 64, 1e10, "fp32").intensity for b in (4, 128))
    assert four < 2 and gpus_batch > 25 and gpus_batch > 10 * four


def test_the_chapters_ledger():
    """The page: two 24 GiB cards hold 4.1 times the KV tokens of one; exercise 1, a 24 GiB card
    holds far more than twelve small-pool requests at the GPU's lengths; exercise 2, 128 decodes at
    context 256 stay bandwidth-bound on the H100 (a step a little longer than at B = 1, over a hundred
    times the throughput), a batch of 907 crosses its ridge and fits in 80 GiB;
    exercise 3, the H200 computes the long prompts no faster than the H100 but decodes faster."""
    from minillm.lab.gpus import lookup_gpu

    cfg = load_config("llama-3.1-8b")
    one, two = (ledger.memory_budget(c, "24GiB").tokens for c in (cfg, ledger.card_config(cfg, 2)))
    assert round(two / one, 1) == 4.1
    assert ledger.memory_budget(cfg, "24GiB", 0.92).concurrent_requests(1024 + 128) > 2 * 12
    h100, h200 = lookup_gpu("H100 SXM"), lookup_gpu("H200")

    def decode(batch, ctx, spec):
        return ledger.decode_step(cfg, batch, ctx, spec.bandwidth).floor(spec.bf16_flops)

    cross = next(b for b in range(1, 4096) if decode(b, 256, h100).bound == "compute")
    assert decode(128, 256, h100).bound == "memory" and cross == 907
    b1, b128 = decode(1, 256, h100).seconds, decode(128, 256, h100).seconds
    assert b128 / b1 < 1.3 and (128 / b128) / (1 / b1) > 100
    assert ledger.memory_budget(cfg, h100.memory_bytes, 0.92).concurrent_requests(384) > cross

    def prefill(spec):
        return [ledger.mixed_step(cfg, 0, 1, (s, s + 2048), 8192, spec.bf16_flops, spec.bandwidth)
                for s in range(0, 8192, 2048)]

    assert all(f.bound == "compute" for f in prefill(h100) + prefill(h200))
    assert [f.seconds for f in prefill(h200)] == [f.seconds for f in prefill(h100)]
    assert 1.4 < h200.bandwidth / h100.bandwidth < 1.5 and h200.bf16_flops == h100.bf16_flops
    assert decode(3, 8192, h100).bound == decode(3, 8192, h200).bound == "memory"
    assert decode(3, 8192, h200).seconds < decode(3, 8192, h100).seconds
