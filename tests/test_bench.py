"""Recorded benchmarks: the record's keys, the sweeps on the tiny preset, the CLI."""
import argparse
import sys

import pytest
import torch

from minillm.engine.config import load_config
from minillm.lab import bench, records
from minillm.lab import estimate as ledger
from minillm.lab.hardware import DeviceProbe

FIXED_PROBE = DeviceProbe(device="cpu", copy_bandwidth=10e9, matmul_flops=100e9,
                          matmul_dtype="torch.float32")


@pytest.fixture
def fixed_probe(monkeypatch):
    """Known ceilings, so the estimates in the results can be checked exactly."""
    monkeypatch.setattr(bench, "probe_device", lambda device, dtype: FIXED_PROBE)


def test_prefill_sweep_on_tiny(fixed_probe):
    cfg = load_config("tiny")
    results = bench.bench_prefill("tiny", "cpu", None, lengths=[8, 24], repeats=2)
    assert results["model"] == {"name": "tiny", "params": ledger.param_count(cfg), "dtype": "float32",
                                "weight_bytes": ledger.weight_bytes(cfg, "float32")}
    assert results["probe"] == FIXED_PROBE.as_dict() and results["spec"] is None
    assert [p["n"] for p in results["points"]] == [8, 24]
    for point in results["points"]:
        est = ledger.prefill(cfg, point["n"], "float32")
        assert point["estimate"]["flops"] == est.flops
        assert point["estimate"]["time_floor_s"] == est.time_floor(100e9, 10e9)
        assert len(point["seconds"]) == 2 and all(s > 0 for s in point["seconds"])
        assert point["achieved_flops"] == pytest.approx(est.flops / point["median_s"])
        assert point["fraction_of_probed_flops"] == pytest.approx(point["achieved_flops"] / 100e9)


def test_time_prefill_computes_the_logits_it_is_asked_for(monkeypatch):
    """The engine's prefill computes the last row's logits; chapter 预填充's exercise every row's."""
    from minillm.engine.loader import load_model

    model = load_model("tiny", device="cpu", dtype=torch.float32, weights="random")
    rows, compute_logits = [], model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: rows.append(len(hidden)) or compute_logits(hidden))
    assert len(bench.time_prefill(model, 8, repeats=1)) == 1
    assert len(bench.time_prefill(model, 8, repeats=1, every_row_logits=True)) == 1
    calls = bench.WARMUP + 1
    assert rows == [1] * calls + [8] * calls


def test_decode_sweep_on_tiny(fixed_probe):
    cfg = load_config("tiny")
    results = bench.bench_decode("tiny", "cpu", "fp32", batches=[1, 3], contexts=[5, 17], steps=2)
    assert [(p["ctx"], p["batch"]) for p in results["points"]] == [(5, 1), (5, 3), (17, 1), (17, 3)]
    for point in results["points"]:
        est = ledger.decode_step(cfg, point["batch"], point["ctx"], 10e9, "float32")
        assert point["estimate"]["bytes"] == est.bytes
        assert point["estimate"]["kv_read_bytes"] == point["batch"] * point["ctx"] * cfg.num_layers \
            * 2 * cfg.num_kv_heads * cfg.head_dim * 4
        assert point["estimate"]["time_floor_s"] == est.time_floor
        assert len(point["seconds"]) == 2
        assert point["tokens_per_s"] == pytest.approx(point["batch"] / point["median_s"])
        assert point["achieved_bandwidth"] == pytest.approx(est.bytes / point["median_s"])


@pytest.mark.parametrize("kwargs, field", [
    (dict(contexts=[10**9]), "contexts"),
    (dict(contexts=[]), "contexts"),
    (dict(batches=[0]), "batches"),
    (dict(steps=0), "steps"),
    (dict(dtype="int8"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(model_name="no-such-model"), "no-such-model"),
])
def test_decode_rejects_bad_input(kwargs, field):
    args = dict(model_name="tiny", device="cpu", batches=[1], contexts=[8], steps=1) | kwargs
    with pytest.raises(ValueError, match=field):
        bench.bench_decode(**args)


def test_prefill_rejects_bad_input():
    with pytest.raises(ValueError, match="lengths"):
        bench.bench_prefill("tiny", "cpu", lengths=[0])
    with pytest.raises(ValueError, match="repeats"):
        bench.bench_prefill("tiny", "cpu", lengths=[8], repeats=0)


def _cli(argv):
    parser = argparse.ArgumentParser()
    bench.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_writes_a_record_the_book_can_read(tmp_path, capsys):
    out = tmp_path / "cpu-decode.json"
    code = _cli(["bench", "decode", "--model", "tiny", "--device", "cpu", "--batches", "1", "2",
                 "--contexts", "8", "--steps", "2", "--out", str(out)])
    assert code == 0
    assert "record written" in capsys.readouterr().out
    [record] = records.find("decode", device="cpu", directory=tmp_path, model="tiny")
    assert record.params == {"model": "tiny", "device": "cpu", "dtype": None, "batches": [1, 2],
                             "contexts": [8], "steps": 2, "quantization": None, "group_size": 32,
                             "kv_cache_dtype": "auto"}
    probe = record.results["probe"]
    assert probe["copy_bandwidth"] > 0 and probe["matmul_flops"] > 0
    assert probe["ridge_point"] == pytest.approx(probe["matmul_flops"] / probe["copy_bandwidth"])
    assert [p["batch"] for p in record.points()] == [1, 2] and [p["batch"] for p in record.points(batch=2)] == [2]
    assert records.find("decode", directory=tmp_path) == []  # a CPU record is not a GPU record


def test_cli_error_is_one_line(tmp_path, capsys):
    code = _cli(["bench", "prefill", "--model", "no-such-model", "--device", "cpu",
                 "--out", str(tmp_path / "x.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


def test_out_of_memory_point_is_recorded_not_fatal(fixed_probe, monkeypatch):
    timed = bench.time_decode_step

    def time_or_oom(model, batch, ctx, steps, kv_dtype=None):
        if batch == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return timed(model, batch, ctx, steps, kv_dtype)

    monkeypatch.setattr(bench, "time_decode_step", time_or_oom)
    results = bench.bench_decode("tiny", "cpu", batches=[1, 3], contexts=[8], steps=1)
    ok, oom = results["points"]
    assert "error" not in ok and ok["median_s"] > 0
    assert oom["error"] == "out of memory" and "seconds" not in oom
    assert oom["estimate"]["bytes"] > ok["estimate"]["bytes"]
    assert "out of memory" in bench.format_decode(results)


def test_paged_decode_sweep_matches_contiguous_attention(fixed_probe):
    cfg = load_config("tiny")
    q, k_cache, v_cache, tables, lens = bench.paged_decode_batch(cfg, [37, 37], 8, torch.float32, "cpu")
    assert tables.shape == (2, 5) and len(set(tables.flatten().tolist())) == 10  # every block its own
    assert tables[0].tolist() == [0, 2, 4, 6, 8]  # handed out round-robin: scattered over the pool
    k, v = bench.gather_contiguous(k_cache, v_cache, tables, 37)
    from minillm.engine.kernels import paged_decode_attention
    scale = cfg.head_dim ** -0.5
    torch.testing.assert_close(paged_decode_attention(q, k_cache, v_cache, tables, lens, scale),
                               bench.contiguous_decode_attention(q, k, v, scale))
    results = bench.bench_paged_decode("tiny", "cpu", "fp32", batch=2, contexts=[16, 40], block_size=8,
                                       repeats=2)
    for point, ctx in zip(results["points"], [16, 40]):
        assert point["ctx"] == ctx and point["backend"] == "torch" and len(point["seconds"]) == 2
        assert point["kv_bytes"] == 2 * 2 * ctx * cfg.num_kv_heads * cfg.head_dim * 4
        assert point["fraction_of_probed_bandwidth"] == pytest.approx(point["kv_bytes"] / point["median_s"] / 10e9)


def test_host_bench_splits_each_step_into_engine_and_model_time():
    from minillm.lab import bench_host

    result = bench_host.bench_host("cpu", batch=8, ctx=48, steps=3)
    assert len(result["step_seconds"]) == len(result["engine_seconds"]) == 3
    for wall, model, engine in zip(result["step_seconds"], result["model_seconds"], result["engine_seconds"]):
        assert 0 < model < wall and engine == pytest.approx(wall - model)
    launches = result["launches"]
    assert launches["per_layer"] > 0 and launches["model"] == "llama-3.1-8b"
    assert launches["per_step"] == launches["outside_layers"] + 32 * launches["per_layer"]
    assert launches["triton_per_step"] == 0  # the CPU runs the torch reference attention
    assert "aten ops" in result["measures"]["launches"] and "no-op" in result["measures"]["engine_seconds"]
    assert "graphs" not in result  # eager vs CUDA graphs is timed on CUDA only
    text = bench_host.format_host(result)
    assert "the engine's own Python per step" in text and "0 Triton launches per layer" in text


def test_launch_counter_counts_aten_ops_and_the_triton_hook():
    from triton import knobs

    from minillm.lab.bench_host import LaunchCounter

    with LaunchCounter() as counter:
        (torch.ones(3) + 1).sum()
        knobs.runtime.launch_enter_hook("metadata")  # as a compiled Triton launch calls it
    assert (counter.aten_ops, counter.triton_launches) == (3, 1)
    knobs.runtime.launch_enter_hook("metadata")  # outside: not counted, the hook is gone
    assert counter.triton_launches == 1 and not knobs.runtime.launch_enter_hook.calls


def test_plan_bench_caps_the_allocator_of_an_indexed_cuda_device(monkeypatch):
    """The plan bench's CUDA branch with only the driver calls stubbed (no GPU here): torch's own
    ``set_per_process_memory_fraction`` checks its arguments, and since torch 2.11 it refuses a
    device without an index, which is what ``resolve_device("cuda")`` gives."""
    from minillm.lab import bench_plan

    fractions = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (130 * ledger.GiB, 140 * ledger.GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction",
                        lambda fraction, index: fractions.append((fraction, index)), raising=False)
    limit, fields = bench_plan.emulate_card(24 * ledger.GiB, torch.device("cuda"))
    assert limit == 24 * ledger.GiB and fractions == [(24 / 140, 0)]
    assert fields == {"device_before": {"free_bytes": 130 * ledger.GiB, "total_bytes": 140 * ledger.GiB},
                      "memory_fraction": 24 / 140}
    with pytest.raises(ValueError, match="specified index"):  # the call as it was
        torch.cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))
    with pytest.warns(UserWarning, match="more than NVIDIA H200 reports"):
        limit, _ = bench_plan.emulate_card(200 * ledger.GiB, torch.device("cuda", 0))
    assert limit == 140 * ledger.GiB and fractions[-1] == (1.0, 0)
    assert bench_plan.emulate_card(ledger.GiB, torch.device("cpu")) == (ledger.GiB, {})


def test_step_breakdown_splits_the_profiled_step_and_sets_the_floor(monkeypatch, one_thread):
    from minillm.lab import bench_step

    monkeypatch.setattr(bench_step, "probe_device", lambda device: FIXED_PROBE)
    r = bench_step.bench_step_breakdown("tiny", "cpu", quantization="int8", ctx=20, steps=3)
    parts = r["parts_s"]
    assert list(parts) == [*bench_step.PARTS, bench_step.OTHER, bench_step.PYTHON]
    assert all(parts[p] > 0 for p in bench_step.PARTS)  # every labelled part ran in every step
    assert sum(parts.values()) == pytest.approx(r["profiled_step_s"])
    cfg = load_config("tiny")
    nbytes = ledger.decode_read_bytes(cfg, "float32", "int8") + ledger.kv_bytes(cfg, 23, "float32")
    flops = ledger.matmul_flops_per_token(cfg) + ledger.attention_flops_per_token(cfg, 23)
    floor = ledger.roofline_floor(flops, nbytes, FIXED_PROBE.matmul_flops, FIXED_PROBE.copy_bandwidth)
    assert r["floor"]["bytes"] == nbytes and r["floor"]["seconds"] == floor.seconds
    assert r["floor_share"] == pytest.approx(floor.seconds / r["step_s"])
    text = bench_step.format_step_breakdown(r)
    assert all(part in text for part in parts) and "quantization int8)" in text
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        bench_step.decoding_request("no-such-model", ctx=20, steps=0)  # before anything is loaded


def test_llamacpp_bench_needs_a_gguf_and_the_optional_package(monkeypatch, capsys):
    from minillm.__main__ import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed: import fails
    assert main(["bench", "llamacpp", "--model", "tiny", "--threads", "1"]) == 2
    assert "needs a .gguf file" in capsys.readouterr().err
    assert main(["bench", "llamacpp", "--threads", "1"]) == 2
    assert "pip install llama-cpp-python" in capsys.readouterr().err
    assert main(["bench", "llamacpp", "--threads", "1", "--max-tokens", "1"]) == 2
    assert "new_tokens must be an int >= 2, got 1" in capsys.readouterr().err
    assert main(["bench", "llamacpp", "--threads", "1", "--e2e-tokens", "-1"]) == 2
    assert "e2e_tokens must be an int >= 0, got -1" in capsys.readouterr().err


def test_the_end_to_end_row_times_the_users_command_in_a_fresh_process():
    """minillm's side of ``bench llamacpp``'s end-to-end row: ``python -m minillm generate`` on the
    real model, its answer cut at the tokens asked for (the chat prompt's greedy answer is longer)."""
    from minillm.lab.bench_llamacpp import minillm_process

    seconds, tokens = minillm_process("smollm2-135m", 3, 1, ["--quantization", "int4"])
    assert tokens == 3 and seconds > 0
    with pytest.raises(ValueError, match="(?s)failed: .*unknown model .no-such-model."):
        minillm_process("no-such-model", 3, 1)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_linear_layers_alone_run_every_linear_once_a_sample(quantization):
    from minillm.engine.loader import load_model
    from minillm.engine.quantization import Int4Linear, Int8Linear

    model = load_model("tiny", device="cpu", weights="random", quantization=quantization)
    calls = {}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, Int4Linear, Int8Linear)):
            module.register_forward_hook(lambda m, args, out, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    samples = bench.time_linear_layers(model, 1, repeats=3)
    assert len(samples) == 3 and min(samples) > 0
    layers = model.config.num_layers
    linears = layers * (4 if quantization is None else 2) + layers * (3 if quantization is None else 2) + 1
    assert len(calls) == linears and set(calls.values()) == {3 + bench.WARMUP}
