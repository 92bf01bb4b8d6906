"""``scripts/gpu_check.sh``, the one command a lent GPU runs, dry-run on this CPU with CUDA absent
and the server and book stacks hidden as they are there: every step is reached, bounded by its
time limit, and writes its record (the benchmarks, at the tiny preset) or lists what it would run
(the GPU-only tests); the limits fit a 10-minute command. About a minute and a half on two cores."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
BUDGET_S = 540  # a lent machine runs one command for at most 600 s; its start and copies take more
STEPS = ("environment", "cuda-tests", "kernel-tests", "prefill", "decode", "paged-decode",
         "throughput", "host", "plan-24gib")
RECORDS = {"prefill": "prefill", "decode": "decode", "paged-decode": "paged-decode",
           "throughput": "throughput", "host": "host", "plan-24gib": "plan"}  # step: record kind
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LIMIT_SCALE = 4  # this CPU is busier and slower than an H200 machine's
# Installed here (requirements.txt), absent on the lent machine (its image's package list).
ABSENT_THERE = ("fastapi", "uvicorn", "openai", "jupyterlab", "jupyter_book", "ipykernel",
                "ipywidgets", "IPython", "myst_nb", "nbclient", "nbformat", "nbmake", "gguf",
                "mistral_common", "jieba", "mplfonts", "sphinx")
HIDE = f"""
import sys
from importlib.machinery import PathFinder

class WithoutAbsent(PathFinder):  # imports of {ABSENT_THERE!r} find nothing, as on the lent machine
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in {set(ABSENT_THERE)!r} else super().find_spec(name, path, target)

sys.meta_path[sys.meta_path.index(PathFinder)] = WithoutAbsent
"""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``bash scripts/gpu_check.sh --dry-run OUTDIR``: its exit status, its log and OUTDIR."""
    out, site = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(HIDE)
    env = {**os.environ, "PYTHON": sys.executable, "MINILLM_GIT_COMMIT": COMMIT,
           "LIMIT_SCALE": str(LIMIT_SCALE), "PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--dry-run", str(out)], env=env,
                          capture_output=True, text=True, timeout=LIMIT_SCALE * BUDGET_S)
    return done.returncode, (out / "gpu_check.log").read_text(), out


def test_every_step_is_reached_bounded_and_done(dry_run):
    status, log, _ = dry_run
    started = re.findall(r"\] start (\S+) \(limit (\d+)s\)", log)
    assert [name for name, _ in started] == list(STEPS)
    ended = re.findall(r"\] (done|FAILED) (\S+)", log)
    assert ended == [("done", name) for name in STEPS], log[-3000:]
    assert status == 0
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)", (SCRIPTS / "gpu_record.sh").read_text(), re.M)[1])
    on_gpu = sum(int(limit) // LIMIT_SCALE + kill_after for _, limit in started)
    assert on_gpu < BUDGET_S, f"the steps may take {on_gpu} s on a GPU"


def test_the_gpu_only_tests_are_listed_and_the_missing_stacks_named(dry_run):
    _, log, _ = dry_run
    assert f"commit {COMMIT}" in log
    assert "not here, not needed: fastapi, uvicorn, openai, jupyterlab" in log  # hidden, as there
    for test in ("tests/test_cuda.py::test_decode_graphs_give_the_eager_tokens",
                 "tests/test_cuda.py::test_swap_round_trips_through_pinned_memory",
                 "tests/test_kernels.py::test_decode_pieces_follow_the_context_not_the_table_width",
                 "tests/test_kernel_compile.py::test_after_warmup_a_run_compiles_nothing"):
        assert test in log


def test_each_benchmark_writes_its_record_with_the_commit_passed_in(dry_run):
    _, _, out = dry_run
    names = sorted(path.name for path in out.iterdir())
    assert len(names) <= 8  # what a lent machine sends back
    assert names == sorted(["gpu_check.log"] + [f"cpu-{step}-quick.json" for step in RECORDS])
    for step, kind in RECORDS.items():
        record = json.loads((out / f"cpu-{step}-quick.json").read_text())
        assert record["kind"] == kind and record["environment"]["git_commit"] == COMMIT
        assert record["environment"]["device"]["type"] == "cpu"


def test_a_step_that_hangs_is_stopped_at_its_limit(tmp_path):
    script = f'source {SCRIPTS / "gpu_record.sh"}; LOG={tmp_path}/log; ' \
             'step hangs 1 sleep 60; step fine 5 true; echo "failed=$FAILED"'
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert time.monotonic() - start < 10
    assert done.stdout.strip().endswith("failed=1")
    log = (tmp_path / "log").read_text()
    assert "FAILED hangs (exit 124; 124 or 137 = over its 1s limit)" in log and "done fine" in log


def test_without_git_or_a_commit_it_says_how_to_pass_one(tmp_path):
    copy = tmp_path / "copy"
    (copy / "scripts").mkdir(parents=True)
    (copy / "scripts" / "gpu_record.sh").write_text((SCRIPTS / "gpu_record.sh").read_text())
    env = {k: v for k, v in os.environ.items() if k != "MINILLM_GIT_COMMIT"}
    done = subprocess.run(["bash", "-c", f"source {copy}/scripts/gpu_record.sh; LOG={tmp_path}/log; "
                           "resolve_commit; echo \"commit=${MINILLM_GIT_COMMIT:-}\""],
                          env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.stdout.strip().endswith("commit=")
    assert "MINILLM_GIT_COMMIT=<sha> bash" in (tmp_path / "log").read_text()
