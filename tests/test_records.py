"""One records module: benchmark records (write, find) and run records (save, load)."""
import json
import socket
from datetime import datetime

import pytest

from minillm import LLM, SamplingParams
from minillm.lab import records


def test_environment_names_the_device_not_the_host():
    env = records.environment("cpu")
    assert env["device"]["type"] == "cpu" and env["device"]["name"]
    assert env["device"]["memory_bytes"] > 0
    for key in ("torch", "triton", "transformers", "python", "git_commit", "date"):
        assert env[key], key
    assert datetime.fromisoformat(env["date"]).utcoffset().total_seconds() == 0
    hostname = socket.gethostname()
    if len(hostname) >= 4:
        assert hostname not in json.dumps(env)


def test_git_commit_can_be_given(monkeypatch):
    monkeypatch.setenv("MINILLM_GIT_COMMIT", "abc123")
    assert records.git_commit() == "abc123"
    assert records.environment("cpu")["git_commit"] == "abc123"


def _gpu_record(path, kind, model, date, points):
    record = {"kind": kind, "params": {"model": f"data/models/{model}"},
              "environment": {"device": {"type": "cuda", "name": "NVIDIA H200"}, "date": date},
              "results": {"model": {"name": model}, "points": points}}
    path.write_text(json.dumps(record))


def test_write_then_find(tmp_path):
    path = tmp_path / "sub" / "x.json"
    written = records.write(path, "prefill", {"model": "tiny"}, {"points": [{"n": 8, "median_s": 1.5}]}, "cpu")
    assert json.loads(path.read_text()) == written
    assert tuple(written) == ("kind", "params", "environment", "results")
    [found] = records.find("prefill", device="cpu", directory=path.parent)
    assert (found.model, found.points(), found.path) == ("tiny", [{"n": 8, "median_s": 1.5}], path)
    with pytest.raises(ValueError, match="kind"):
        records.write(path, "", {}, {}, "cpu")


def test_find_matches_and_sorts_newest_first(tmp_path):
    _gpu_record(tmp_path / "a.json", "decode", "llama-3.1-8b", "2026-01-02T00:00:00+00:00",
                [{"batch": 1, "median_s": 0.02}, {"batch": 8, "error": "out of memory"}])
    _gpu_record(tmp_path / "b.json", "decode", "llama-3.1-8b", "2026-03-01T00:00:00+00:00", [])
    _gpu_record(tmp_path / "c.json", "decode", "qwen2.5-0.5b", "2026-05-01T00:00:00+00:00", [])
    _gpu_record(tmp_path / "d.json", "prefill", "llama-3.1-8b", "2026-05-01T00:00:00+00:00", [])
    found = records.find("decode", directory=tmp_path, model="llama-3.1-8b")
    assert [r.path.name for r in found] == ["b.json", "a.json"]
    assert found[1].points() == [{"batch": 1, "median_s": 0.02}]  # the OOM point has no timing
    assert found[1].device == "NVIDIA H200"
    assert records.find("decode", device="cpu", directory=tmp_path) == []
    assert records.find("decode", directory=tmp_path, model="no-such") == []


def test_run_record_round_trip(tmp_path):
    llm = LLM("tiny", device="cpu", weights="random", num_kv_blocks=16)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    path = records.save_run(llm, tmp_path / "run.json")
    record = records.load_run(path)
    assert record["format"] == records.RUN_FORMAT
    assert record["engine"]["num_kv_blocks"] == 16 and record["engine"]["block_size"] == 16
    assert len(record["requests"]) == 2 and record["summary"]["output_tokens"] == 6
    assert record["stats"]["steps"][0]["admission_stop"] is None
    assert record["memory"]["kv_cache_bytes"] == llm.kv_cache.reserved_bytes


@pytest.mark.parametrize("bad, match", [
    ({"format": "other"}, "not a minillm run record"),
    ({"format": records.RUN_FORMAT}, "missing model"),
    ([1, 2], "JSON object"),
])
def test_load_run_names_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        records.load_run(bad)


def test_load_run_reads_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        records.load_run(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        records.load_run(tmp_path / "bad.json")
