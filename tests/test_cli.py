"""``python -m minillm estimate``: the ledger on the command line, and its errors."""
import json
import os
import subprocess
import sys

import pytest
import torch

from minillm.__main__ import build_parser, main


def run(*argv):
    return subprocess.run([sys.executable, "-m", "minillm", *argv], capture_output=True, text=True)


def test_estimate_prints_the_seed_figures(capsys):
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    for figure in ("8,030,261,248", "58,347", "14.96 GiB", "128 KiB", "<= 2,133 tok/s"):
        assert figure in out


def test_estimate_on_an_unseen_directory(tmp_path, capsys):
    config = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["estimate", "--model", str(tmp_path), "--json"]) == 0
    by_hand = 100 * 32 * 2 + 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32) + 32
    assert json.loads(capsys.readouterr().out)["parameters"] == f"{by_hand:,}"


@pytest.mark.parametrize("argv,message", [
    (["--model", "no-such-model"], "presets: "),
    (["--model", "tiny", "--gpu", "Voodoo 5"], "known: RTX 4090"),
    (["--model", "tiny", "--gpu-memory", "-3GiB"], "cannot read the size"),
    (["--model", "tiny", "--util", "1.5"], "--util must be in (0, 1]"),
])
def test_estimate_errors_are_one_line_exit_2(argv, message):
    result = run("estimate", *argv)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_generate_prints_the_new_tokens(capsys, monkeypatch):
    """No sizing argument: the CPU's pool is $MINILLM_CPU_KVCACHE_SPACE GiB (small here)."""
    monkeypatch.setenv("MINILLM_CPU_KVCACHE_SPACE", "0.01")
    argv = ["generate", "tiny", "--weights", "random", "--token-ids", "5,6,7", "--max-tokens", "4"]
    assert main(argv) == 0
    first = capsys.readouterr().out.split()
    assert len(first) == 4 and all(0 <= int(t) < 4096 for t in first)


def test_generate_ignore_eos_answers_exactly_max_tokens(capsys):
    """The real model's short greedy answer to "hi" stops at its end-of-sequence token;
    --ignore-eos goes on past it to exactly --max-tokens tokens, the same answer first."""
    argv = ["generate", "smollm2-135m", "--prompt", "hi", "--max-tokens", "40", "--quantization", "int4"]
    assert main(argv) == 0
    stopped = capsys.readouterr()
    assert "finish=stop" in stopped.err and int(stopped.err.split("[")[-1].split()[0]) < 40
    assert main([*argv, "--ignore-eos"]) == 0
    longer = capsys.readouterr()
    assert "[40 tokens, finish=length" in longer.err and longer.out.startswith(stopped.out.rstrip("\n"))


def test_serve_turns_prefix_caching_off_and_passes_it_to_the_engine():
    from minillm.server.cli import ENGINE_OPTIONS

    assert "enable_prefix_caching" in ENGINE_OPTIONS
    parser = build_parser()
    assert parser.parse_args(["serve", "tiny", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parser.parse_args(["serve", "tiny", "--enable-prefix-caching"]).enable_prefix_caching is True
    assert parser.parse_args(["serve", "tiny"]).enable_prefix_caching is None  # the engine's default


def test_compile_decode_reaches_the_engine_from_generate_and_serve(capsys, monkeypatch):
    """generate --compile-decode answers with the tokens of the eager command (the tiny model's
    float32 scores are far from ties); serve passes the flag on only when it is given."""
    from minillm.engine.decode_graph import CompiledDecode
    from minillm.server.cli import ENGINE_OPTIONS

    monkeypatch.setenv("MINILLM_CPU_KVCACHE_SPACE", "0.01")
    steps, run = [], CompiledDecode.run
    monkeypatch.setattr(CompiledDecode, "run", lambda *args: steps.append(1) or run(*args))
    argv = ["generate", "tiny", "--weights", "random", "--token-ids", "5,6,7", "--max-tokens", "6",
            "--temperature", "0"]
    assert main(argv) == 0 and not steps
    eager = capsys.readouterr().out.split()
    assert main([*argv, "--compile-decode"]) == 0
    assert capsys.readouterr().out.split() == eager
    assert len(steps) == 1 + 5  # the warm-up step, then every decode step
    assert "compile_decode" in ENGINE_OPTIONS
    parser = build_parser()
    assert parser.parse_args(["serve", "tiny", "--compile-decode"]).compile_decode is True
    assert parser.parse_args(["serve", "tiny"]).compile_decode is None  # the engine's default


@pytest.mark.parametrize("command", ["prefill", "decode", "paged-decode"])
def test_each_bench_points_at_a_record_of_its_own_kind(command):
    text = run("bench", command, "--help").stdout
    assert f"h200-{command}.json" in " ".join(text.split())
    assert ("decode.json" in text) == (command != "prefill")


def test_generate_without_weights_is_a_clear_error():
    result = run("generate", "tiny", "--token-ids", "5,6")
    assert result.returncode == 2 and "weights='random'" in result.stderr


def test_diagnose_rejects_an_unreadable_record(tmp_path):
    bad = tmp_path / "run.json"
    bad.write_text("{not json")
    result = run("diagnose", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_thread_policy_defaults_to_physical_cores_and_says_so(monkeypatch):
    from minillm.engine.device import physical_cores, set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        cores = physical_cores()
        assert 1 <= cores <= os.cpu_count()
        assert set_threads() == f"{cores} CPU thread{'s' if cores > 1 else ''} (one per physical core)"
        assert torch.get_num_threads() == cores
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_threads() == "1 CPU thread ($OMP_NUM_THREADS)" and torch.get_num_threads() == 1
        assert set_threads(3) == "3 CPU threads (--threads)" and torch.get_num_threads() == 3
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            set_threads(0)
    finally:
        torch.set_num_threads(before)


def test_generate_logs_its_threads_and_refuses_zero():
    argv = ("generate", "tiny", "--weights", "random", "--token-ids", "5,6", "--max-tokens", "2")
    result = run(*argv, "--threads", "1")
    assert result.returncode == 0 and result.stderr.splitlines()[0] == "minillm: 1 CPU thread (--threads)"
    result = run(*argv, "--threads", "0")
    assert result.returncode == 2 and "threads must be an int >= 1, got 0" in result.stderr
