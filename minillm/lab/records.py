"""Every record the project writes and reads (all labs; chapter 先问瓶颈).

Two kinds of record, one module:

* **Benchmark records** ``{kind, params, environment, results}``, written by
  ``python -m minillm bench ...`` with the raw timings and where they were taken (device, library
  versions, git commit, date; no host name). The book's "recorded on GPU" columns read them from
  ``data/measurements/`` with :func:`find`; a record is only ever written by running a benchmark.
* **Run records** (``format: minillm-run-metrics``): one run of the engine, its settings, memory,
  step log and finished requests, written by :func:`save_run` and read back by :func:`load_run`
  (what ``python -m minillm diagnose`` reads).
* **Client run records** (``format: minillm-client-run``): one run of the load generator against
  a server (``minillm.lab.loadgen``), what each request's client saw (TTFT, TPOT, end-to-end,
  errors) and, when the server exports Prometheus metrics, its counters before and after and its
  gauges sampled during the run; :func:`save_client_run` and :func:`load_client_run`.
  ``python -m minillm diagnose`` reads either kind (:func:`load_record`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from minillm.lab.hardware import describe_device
from minillm.lab.metrics import summarize

REPO_ROOT = Path(__file__).resolve().parents[2]
MEASUREMENTS_DIR = REPO_ROOT / "data" / "measurements"
RUN_FORMAT = "minillm-run-metrics"
CLIENT_RUN_FORMAT = "minillm-client-run"


# --- Benchmark records ----------------------------------------------------------------------------

def git_commit() -> str:
    """The commit the code ran at: ``$MINILLM_GIT_COMMIT`` if set (a copy of the tree without
    ``.git``), else ``git rev-parse HEAD``, else ``"unknown"``."""
    if os.environ.get("MINILLM_GIT_COMMIT"):
        return os.environ["MINILLM_GIT_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str) -> dict:
    """Where and with what a measurement was taken (no host name)."""
    info = describe_device(device)
    return {
        "device": {"type": info.type, "name": info.name, "memory_bytes": info.memory_bytes,
                   "spec": info.spec.name if info.spec else None},
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write(path: str | Path, kind: str, params: dict, results: dict, device: torch.device | str) -> dict:
    """Write ``{kind, params, environment, results}`` as JSON to ``path``; return the record."""
    if not kind:
        raise ValueError("kind must be a non-empty name, e.g. 'prefill'")
    record = {"kind": kind, "params": params, "environment": environment(device), "results": results}
    _write_json(path, record)
    return record


def _write_json(path: str | Path, record: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return path


@dataclass(frozen=True)
class BenchRecord:
    """One benchmark record as read from disk."""

    kind: str
    params: dict
    environment: dict
    results: dict
    path: Path

    @property
    def device(self) -> str:
        """The device's name, e.g. ``NVIDIA H200``."""
        return self.environment["device"]["name"]

    @property
    def model(self) -> str:
        """The model's name (a preset, or a folder's last part)."""
        model = self.results.get("model")
        return model["name"] if isinstance(model, dict) else model or Path(self.params["model"]).name

    def points(self, **match) -> list[dict]:
        """The measured points of a sweep (those with timings), optionally with fields equal to ``match``."""
        return [p for p in self.results.get("points", []) if "median_s" in p
                and all(p.get(k) == v for k, v in match.items())]


def find(kind: str, device: str | None = "cuda", directory: str | Path = MEASUREMENTS_DIR,
         **match) -> list[BenchRecord]:
    """Records of ``kind``, newest first. ``device``: the device type (``"cuda"``, ``"cpu"``; None:
    any). ``match``: ``model=`` compares the model's name, other keys the record's params."""
    found = []
    for path in sorted(Path(directory).glob("*.json")):
        with open(path) as f:
            raw = json.load(f)
        if raw.get("kind") != kind:
            continue
        record = BenchRecord(raw["kind"], raw["params"], raw["environment"], raw["results"], path)
        if device is not None and record.environment["device"]["type"] != device:
            continue
        if all((record.model if key == "model" else record.params.get(key)) == value
               for key, value in match.items()):
            found.append(record)
    return sorted(found, key=lambda r: r.environment["date"], reverse=True)


def latest(kind: str, **match) -> BenchRecord | None:
    """The newest GPU record of ``kind`` matching ``match`` (see :func:`find`), or None."""
    found = find(kind, **match)
    return found[0] if found else None


# --- Run records ----------------------------------------------------------------------------------

REQUIRED = {  # what a run record must hold, by section
    "record": ("model", "dtype", "engine", "memory", "stats", "requests"),
    "engine": ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
               "enable_chunked_prefill", "preemption_mode", "scheduling"),
    "memory": ("weight_bytes", "kv_bytes_per_block", "kv_cache_bytes", "plan"),
    "stats": ("steps", "num_preemptions"),
    "step": ("start", "end", "scheduled", "batch_size", "num_prefill_tokens", "num_decode_tokens",
             "num_sampled", "preempted", "admission_stop", "num_free_blocks_before",
             "num_free_blocks", "num_running", "num_waiting"),
    "request": ("request_id", "finish_reason", "num_prompt_tokens", "num_output_tokens",
                "queueing", "ttft", "e2e"),
    "client_record": ("server", "workload", "duration_s", "requests", "server_metrics"),
    "client_request": ("start", "num_prompt_tokens", "num_output_tokens", "ttft", "tpot", "e2e",
                       "finish_reason", "error", "hung_up"),
}


def run_record(engine, slo=None) -> dict:
    """One run of ``engine`` (an ``LLMEngine`` or ``LLM``) as a JSON-ready dictionary: model, device,
    settings, memory, the step log, every finished request and the summary."""
    device = engine.model.device
    kv = engine.kv_cache
    finished = engine.recorder.finished
    requests = [{"request_id": r.request_id, "finish_reason": r.finish_reason,
                 "num_cached_tokens": r.num_cached_tokens, "num_preemptions": r.num_preemptions,
                 **r.metrics.to_dict()} for r in finished]
    info = describe_device(device)
    return {
        "format": RUN_FORMAT,
        "version": 2,
        "model": dataclasses.asdict(engine.model.config),
        "device": {"type": device.type, "name": info.name,
                   "total_memory_bytes": info.memory_bytes if device.type == "cuda" else None},
        "dtype": str(kv.kv.dtype).removeprefix("torch."),
        "engine": dataclasses.asdict(engine.config),
        "memory": {"weight_bytes": sum(p.nbytes for p in engine.model.parameters()),
                   "kv_bytes_per_block": kv.bytes_per_token * kv.block_size,
                   "kv_cache_bytes": kv.reserved_bytes,
                   "plan": engine.memory_plan.as_dict() if engine.memory_plan else None},
        "stats": engine.stats(),
        "requests": requests,
        "summary": summarize([r.metrics for r in finished], slo) if finished else None,
    }


def save_run(engine, path: str | Path, slo=None) -> Path:
    """Write :func:`run_record` as JSON to ``path``; returns the path."""
    return _write_json(path, run_record(engine, slo))


RECORD_KINDS = {RUN_FORMAT: ("run record", "minillm.lab.records.save_run"),
                CLIENT_RUN_FORMAT: ("client run record", "python -m minillm loadgen")}


def _read(record, fmt: str | None = None) -> dict:
    """A record dict as is, or read from a path; with ``fmt``, checked to be of that format."""
    if isinstance(record, (str, Path)):
        path = Path(record)
        try:
            record = json.loads(path.read_text())
        except OSError as err:
            raise ValueError(f"cannot read the run record {path}: {err.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"the run record {path} is not JSON ({err})") from None
    if not isinstance(record, dict):
        raise ValueError(f"a run record is a JSON object, got {type(record).__name__}")
    if fmt is not None and record.get("format") != fmt:
        what, writer = RECORD_KINDS[fmt]
        raise ValueError(f"not a minillm {what}: format is {record.get('format')!r}, expected "
                         f"{fmt!r} (written by {writer})")
    return record


def load_record(record) -> dict:
    """A run record or a client run record (by its ``format``), checked as :func:`load_run` or
    :func:`load_client_run` checks it."""
    record = _read(record)
    return load_client_run(record) if record.get("format") == CLIENT_RUN_FORMAT else load_run(record)


def load_run(record) -> dict:
    """A run record dict as is, or read from a path; ``ValueError`` naming what is wrong or missing."""
    record = _read(record, RUN_FORMAT)
    missing = _missing(record, "record", "")
    for section in ("engine", "memory", "stats"):
        if section in record:
            missing += _missing(record[section], section, f"{section}.")
    _check_complete(missing, RUN_FORMAT)
    steps, requests = record["stats"]["steps"], record["requests"]
    if not isinstance(steps, list) or not isinstance(requests, list):
        raise ValueError("stats.steps and requests of a run record must be lists")
    if not steps or not requests:
        raise ValueError("the run record has no steps or no finished requests: run the engine "
                         "on some requests before saving it")
    for i, step in enumerate(steps):
        missing += _missing(step, "step", f"stats.steps[{i}].")
    for i, request in enumerate(requests):
        missing += _missing(request, "request", f"requests[{i}].")
    _check_complete(missing, RUN_FORMAT)
    return record


def save_client_run(record: dict, path: str | Path) -> Path:
    """Write a client run record (``minillm.lab.loadgen.run_load``'s result) as JSON to ``path``."""
    return _write_json(path, load_client_run(record))


def load_client_run(record) -> dict:
    """A client run record dict as is, or read from a path; ``ValueError`` naming what is wrong."""
    record = _read(record, CLIENT_RUN_FORMAT)
    missing = _missing(record, "client_record", "")
    if not missing and (not isinstance(record["requests"], list) or not record["requests"]):
        raise ValueError("the client run record has no requests")
    for i, request in enumerate(record.get("requests") or []):
        missing += _missing(request, "client_request", f"requests[{i}].")
    _check_complete(missing, CLIENT_RUN_FORMAT)
    return record


def _check_complete(missing: list[str], fmt: str) -> None:
    """``ValueError`` naming the first few of the ``missing`` keys of a record of ``fmt``."""
    if missing:
        raise ValueError(f"incomplete {RECORD_KINDS[fmt][0]}: missing {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _missing(section, kind: str, prefix: str) -> list[str]:
    """Dotted paths of the required keys ``section`` lacks (itself, when it is no object)."""
    if not isinstance(section, dict):
        return [prefix.rstrip(".") + " (not an object)"]
    return [prefix + key for key in REQUIRED[kind] if key not in section]
