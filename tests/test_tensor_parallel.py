"""Tensor parallelism: tp=2 computes what tp=1 computes, its ranks end with their engine, and a
dead rank is an error in the caller within seconds (gloo processes on the CPU)."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file

from minillm import LLM, LLMEngine, SamplingParams, load_model
from minillm.engine.config import ModelConfig, load_config
from minillm.engine.model import Transformer
from minillm.engine.parallel import TensorParallel, timed_collectives
from minillm.engine.planner import model_bytes, plan
from minillm.lab import estimate as L
from minillm.server.launcher import serve_in_background

BASE = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
            rope_theta=10000.0, eos_token_id=None)
CONFIGS = {
    "llama": BASE,
    "qwen2-bias-tied": BASE | dict(model_type="qwen2", vocab_size=120, intermediate_size=128,
                                   tie_word_embeddings=True),
    "mqa": BASE | dict(num_key_value_heads=1),  # one KV head, replicated on both ranks
    # held out: an odd vocabulary (padded shards), MHA, biases on o and down (added once)
    "held-out": BASE | dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                            num_attention_heads=6, num_key_value_heads=6, attention_bias=True, mlp_bias=True),
}
ENGINE = dict(device="cpu", dtype=torch.float64, block_size=4, num_kv_blocks=16, max_num_seqs=4,
              max_num_batched_tokens=16, enable_prefix_caching=True)
SHARED = list(range(3, 15))  # a 12-token prefix (3 blocks) two prompts share
FIRST = [SHARED + [20, 21, 22, 23, 24, 25, 26, 27], [5, 6, 7], list(range(40, 63)), SHARED + [30, 31]]
SECOND = [SHARED + [50, 51, 52], list(range(40, 55)) + [7]]  # prefix hits on the first call's blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _checkpoint(folder, hf: dict) -> None:
    """A Hugging Face folder of random float64 weights, biases random too (so that their cuts count)."""
    cfg = ModelConfig.from_dict(hf)
    model = load_model(cfg, device="cpu", dtype=torch.float64, weights="random")
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".bias"):
            tensor = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.1
        if not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            tensors[name] = tensor.clone()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf | {"torch_dtype": "float64"}))


def _run(llm: LLM) -> tuple[list[list[int]], dict, dict]:
    first = [o.token_ids for o in llm.generate(FIRST, GREEDY, use_tqdm=False)]
    stats_first = llm.stats()
    second = [o.token_ids for o in llm.generate(SECOND, GREEDY, use_tqdm=False)]
    return first + second, stats_first, llm.stats()


def _alive(pids: list[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            pass
    return alive


def _gone(pids: list[int], within: float = 0.0) -> bool:
    """No process of ``pids`` runs (now, or within ``within`` seconds)."""
    deadline = time.monotonic() + within
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pids)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_greedy_tokens_equal_tp1(tmp_path, name):
    """Chunked prefill, mixed prefill/decode steps, preemption (swap for the held-out shape) and
    prefix hits: the same float64 greedy tokens on one rank and on two; and the same prompt
    logprobs of a prompt longer than the budget (scored in chunks, steps that sample nothing)."""
    _checkpoint(tmp_path, CONFIGS[name])
    mode = "swap" if name == "held-out" else "recompute"
    results, prompt_logprobs = {}, {}
    for size in (1, 2):
        with LLM(tmp_path, **ENGINE, preemption_mode=mode, tensor_parallel_size=size) as llm, \
                timed_collectives() as clock:
            results[size] = _run(llm)
            calls = dict(clock.calls)
            (out,) = llm.generate([FIRST[2]], dataclasses.replace(GREEDY, prompt_logprobs=2), use_tqdm=False)
            prompt_logprobs[size] = [(e.token_id, e.logprob, e.top) for e in out.prompt_logprobs[1:]]
            pids = llm.workers.pids if llm.workers else []
            if size == 2:
                assert len(pids) == 1 and llm.model.config.num_heads == CONFIGS[name]["num_attention_heads"] // 2
        assert _gone(pids)
        if size == 1:
            assert clock.calls == {}
    tokens, first, second = results[2]
    assert tokens == results[1][0]
    assert len(prompt_logprobs[2]) == len(FIRST[2]) - 1
    for (token, value, top), (want_token, want, want_top) in zip(prompt_logprobs[2], prompt_logprobs[1], strict=True):
        assert token == want_token and value == pytest.approx(want, abs=1e-9)
        assert [t for t, _ in top] == [t for t, _ in want_top]
    # rank 0's collectives: per step one broadcast of the inputs, 2 all-reduces per layer and the
    # embedding's, one all-gather of the logits when a request samples
    steps = first["steps"] + second["steps"]
    layers = CONFIGS[name]["num_hidden_layers"]
    assert calls == {"broadcast": len(steps), "all_reduce": (2 * layers + 1) * len(steps),
                           "all_gather": sum(s["num_sampled"] > 0 for s in steps)}
    assert first["num_preemptions"] > 0 and second["prefix_hit_tokens"] >= 2 * len(SHARED)
    steps = first["steps"]
    assert any(s["num_prefill_tokens"] and s["num_decode_tokens"] for s in steps)  # mixed steps
    assert max(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps) == ENGINE["max_num_batched_tokens"]
    if mode == "swap":
        assert sum(s["num_swapped_blocks"] for s in steps) > 0


def test_random_shards_are_slices_of_the_full_random_model():
    cfg = ModelConfig.from_dict(CONFIGS["held-out"])
    full = load_model(cfg, device="cpu", dtype=torch.float64, weights="random").state_dict()
    for rank in (0, 1):
        tp = TensorParallel(rank, 2)
        shard = load_model(cfg, device="cpu", dtype=torch.float64, weights="random", tensor_parallel=tp)
        assert shard.config.num_heads == 3 and shard.model.embed_tokens.num_embeddings == 49
        for name, tensor in shard.state_dict().items():
            assert torch.equal(tensor, tp.shard(name, full[name], cfg)), name
    # the padded last vocabulary row is zero; rank 1's o_proj bias is zero (rank 0 adds it)
    assert not shard.model.embed_tokens.weight[-1].any()
    assert not shard.model.layers[0].self_attn.o_proj.bias.any()


@pytest.mark.parametrize("settings, message", [
    (dict(tensor_parallel_size=5), "must divide num_attention_heads"),
    (dict(tensor_parallel_size=4, model_kv_heads=3), "num_key_value_heads"),
    (dict(tensor_parallel_size=2, quantization="int8"), "does not combine with quantization"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config"),
])
def test_bad_settings_refused_before_any_process_starts(settings, message):
    settings = dict(settings)
    cfg = ModelConfig.from_dict(BASE).replace(num_heads=12, num_kv_heads=settings.pop("model_kv_heads", 2))
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match=message):
        LLM(cfg, device="cpu", weights="random", num_kv_blocks=8, **settings)
    assert {p.pid for p in psutil.Process().children()} <= before | _resource_tracker()


def test_dry_run_plans_one_rank_per_card():
    plans = {n: plan("llama-3.1-8b", gpu_memory="24GiB", max_model_len=8192, tensor_parallel_size=n)
             for n in (1, 2, 8)}
    assert plans[2].bytes_per_block * 2 == plans[1].bytes_per_block == plans[8].bytes_per_block * 8
    assert plans[1].weight_bytes / plans[8].weight_bytes == pytest.approx(8, rel=0.01)  # norms whole
    assert plans[8].num_blocks > plans[2].num_blocks > 2 * plans[1].num_blocks
    with pytest.raises(ValueError, match="dry run"):
        plan("tiny", memory_limit="64MiB", tensor_parallel_size=2)


def test_moe_and_loaded_models_refused():
    with pytest.raises(ValueError, match="mixture of experts"):
        LLM(load_config("mixtral-8x7b"), weights="random", tensor_parallel_size=2)
    model = load_model(ModelConfig.from_dict(BASE), device="cpu", weights="random")
    with pytest.raises(ValueError, match="not a loaded Transformer"):
        LLM(model, num_kv_blocks=8, tensor_parallel_size=2)


def _resource_tracker() -> set[int]:
    """multiprocessing's resource tracker: a child that lives as long as this process."""
    return {p.pid for p in psutil.Process().children() if "resource_tracker" in " ".join(p.cmdline())}


def test_planner_plans_one_rank_and_a_killed_worker_is_an_error_within_seconds():
    cfg, limit = ModelConfig.from_dict(BASE), dict(memory_limit="8MiB", max_model_len=512)
    one = LLM(cfg, device="cpu", weights="random", **limit).memory_plan
    llm = LLM(cfg, device="cpu", weights="random", **limit, tensor_parallel_size=2)
    with torch.device("meta"):
        shard = Transformer(cfg, TensorParallel(0, 2))
    assert llm.memory_plan.weight_bytes == model_bytes(shard) < one.weight_bytes
    assert 2 * llm.memory_plan.bytes_per_block == one.bytes_per_block  # half the KV heads
    assert llm.config.num_kv_blocks == llm.memory_plan.num_blocks > one.num_blocks
    (pid,) = llm.workers.pids
    killed = []
    timer = threading.Timer(0.5, lambda: (os.kill(pid, signal.SIGKILL), killed.append(time.monotonic())))
    timer.start()
    with pytest.raises(RuntimeError, match="rank 1") as err:
        llm.generate([list(range(1, 9))] * 4, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    assert killed and time.monotonic() - killed[0] < 5.0
    assert f"pid {pid}" in str(err.value) or "died" in str(err.value)
    assert _gone([pid])
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], use_tqdm=False)


def test_server_sigterm_ends_its_workers():
    options = dict(weights="random", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    with serve_in_background("tiny", env={"MINILLM_DEVICE": "cpu"}, **options) as server:
        children = [p.pid for p in psutil.Process(server.process.pid).children()]  # rank 1 (and mp's tracker)
        body = json.dumps({"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 4}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 4
        assert server.stop() == 0
    assert children and _gone(children, within=3.0), _alive(children)


def test_workers_end_when_rank0_is_killed(tmp_path):
    """SIGKILL leaves rank 0 no time to clean up: its workers see their pipe close and exit."""
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time\n"
        "from minillm import LLM\n"
        "from minillm.engine.config import load_config\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(load_config('tiny').replace(num_layers=1), device='cpu', weights='random',\n"
        "              num_kv_blocks=8, tensor_parallel_size=2)\n"
        "    print(*llm.workers.pids, flush=True)\n"
        "    time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        workers = [int(pid) for pid in rank0.stdout.readline().split()]
        rank0.kill()
        rank0.wait(10)
        assert workers and _gone(workers, within=5.0), _alive(workers)
    finally:
        rank0.kill()


# --- the ledger ---------------------------------------------------------------------------------

def test_ledger_allreduces_of_llama_8b():
    cfg = load_config("llama-3.1-8b")
    assert L.allreduces_per_token(cfg) == 64 and L.allreduce_message_bytes(cfg) == 8 * L.KiB  # bf16
    assert L.allreduce_message_bytes(cfg, tokens=16, dtype="fp32") == 256 * L.KiB
    assert L.ring_bytes_per_card(8 * L.KiB, 2) == 8 * L.KiB and L.ring_bytes_per_card(8 * L.KiB, 8) == 14 * L.KiB


def test_ledger_weights_and_kv_per_card():
    small, big = load_config("llama-3.1-8b"), load_config("llama-3.1-70b")
    norms = L.param_breakdown(small)["norms"]
    for tp in (1, 2, 4, 8):  # every matrix split, the norms whole
        assert L.weight_bytes_per_card(small, tp) == 2 * ((L.param_count(small) - norms) // tp + norms)
        assert L.kv_bytes_per_token_per_card(big, tp) == 320 * L.KiB // tp
    # past tp = n_kv (8) each card keeps one KV head: its KV per token stops shrinking
    assert L.kv_bytes_per_token_per_card(small, 16) == L.kv_bytes_per_token_per_card(small, 8) == 16 * L.KiB
    fits = {(card, tp): L.memory_budget(L.card_config(big, tp), card).num_blocks > 0
            for card in ("24GiB", "80GiB") for tp in (1, 2, 4, 8)}
    assert [tp for tp in (1, 2, 4, 8) if fits["80GiB", tp]] == [2, 4, 8]
    assert [tp for tp in (1, 2, 4, 8) if fits["24GiB", tp]] == [8]
    # the engine's shard holds what the ledger counts
    with torch.device("meta"):
        shard = Transformer(load_config("qwen2.5-0.5b"), TensorParallel(1, 2)).to(torch.bfloat16)
    assert model_bytes(shard) == L.weight_bytes_per_card(load_config("qwen2.5-0.5b"), 2)


def test_alpha_beta_allreduce_and_the_decode_floor():
    link = L.AllReduceCost(latency=20e-6, bandwidth=25e9)
    assert link.seconds(8 * L.KiB, 1) == 0
    assert link.seconds(8 * L.KiB, 2) == pytest.approx(20e-6 + 8192 / 25e9)
    assert link.latency_share(8 * L.KiB, 2) > 0.98  # one token's message: the latency is the cost
    assert link.latency_share(64 * L.MiB, 2) < 0.01
    cfg, card = load_config("llama-3.1-8b"), (165.2e12, 1008e9)  # an RTX 4090's ceilings
    steps = {tp: L.tensor_parallel_decode(cfg, tp, 1, 4096, *card, link) for tp in (1, 2, 4, 8)}
    assert steps[1].allreduce_seconds == 0 and steps[2].num_allreduces == 64
    assert steps[2].allreduce_seconds == pytest.approx(64 * link.seconds(8 * L.KiB, 2))
    assert steps[2].floor.seconds == pytest.approx(steps[1].floor.seconds / 2, rel=0.01)
    assert steps[2].floor.bound == "memory"
    assert steps[1].tokens_per_s < steps[2].tokens_per_s < steps[4].tokens_per_s < steps[8].tokens_per_s
    assert steps[8].allreduce_share > steps[4].allreduce_share > steps[2].allreduce_share
    # the gain of a second card is half the weights' read time; 64 calls of 200 µs cost more
    slow = L.AllReduceCost(latency=200e-6, bandwidth=25e9)
    assert 64 * 200e-6 > steps[1].floor.seconds / 2
    assert L.tensor_parallel_decode(cfg, 2, 1, 4096, *card, slow).tokens_per_s < steps[1].tokens_per_s
