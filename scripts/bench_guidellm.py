"""vLLM's benchmark tool against minillm's server, checked against the server's own /metrics.

Not part of the test run: guidellm is a heavy install (datasets, pandas, sanic), so it lives in a
virtual environment of its own and this script only calls its command line:

    python -m venv /tmp/gl && /tmp/gl/bin/pip install guidellm==0.8.1
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_guidellm.py --guidellm /tmp/gl/bin/guidellm

It serves MODEL on 127.0.0.1 only (a free port), reads /metrics, runs guidellm's streaming
completions at a fixed concurrency for a fixed number of requests (each step bounded by a
timeout), reads /metrics again and checks that both sides counted the same run: every request
succeeded and none was refused, guidellm's prompt and output tokens are the server's
``prompt_tokens_total`` and ``generation_tokens_total`` growth, and the client's mean TTFT is
no shorter than the server's. It prints the comparison, writes guidellm's JSON and the comparison
under --out, and exits 1 when a check fails (2 for a bad setting or a step that timed out).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from minillm.engine.config import resolve_checkpoint
from minillm.lab.loadgen import parse_metrics
from minillm.server.launcher import serve_in_background

GUIDELLM_TIMEOUT_S = 300  # the benchmark run at most
STARTUP_TIMEOUT_S = 120  # the server's load at most


def tokenizer_folder(model: str, scratch: Path) -> Path:
    """A folder guidellm's ``AutoTokenizer`` can read: the model's own, or the GGUF's tokenizer
    saved into ``scratch``."""
    where = resolve_checkpoint(model)
    if where is None:
        raise ValueError(f"{model!r} is not a model folder, a .gguf file or a preset")
    if where.suffix != ".gguf":
        return where
    from minillm.engine.gguf_file import GGUFFile, gguf_tokenizer

    tokenizer = gguf_tokenizer(GGUFFile(where))
    if tokenizer is None:
        raise ValueError(f"{where} holds no tokenizer, and guidellm needs one to build its prompts")
    tokenizer.save_pretrained(scratch)
    return scratch


def scrape(url: str) -> dict[str, float]:
    backend, values = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    if backend != "minillm":
        raise RuntimeError(f"{url}/metrics has no minillm: metrics")
    return values


def run_guidellm(guidellm: str, server, tokenizer: Path, args, out: Path) -> dict:
    """guidellm's benchmark of ``server`` (its JSON report, also kept as ``out``)."""
    command = [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={server.url},model={server.model},"
                     "request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={args.streams}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                  f"output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=GUIDELLM_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm exited with {done.returncode}:\n{done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")
    return json.loads(out.read_text())["benchmarks"][0]["metrics"]


def compare(report: dict, before: dict, after: dict) -> tuple[list[tuple[str, float, float, bool]], dict]:
    """(what, guidellm's number, the server's, agree?) rows, and the numbers as a dict."""
    def grown(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    def total(metric):
        return report[metric]["successful"]["total_sum"]

    def server_mean(histogram):
        count = grown(f"{histogram}_count")
        return grown(f"{histogram}_sum") / count if count else float("nan")

    totals = report["request_totals"]
    rejected = sum(grown(k) for k in after if k.startswith("request_rejected_total."))
    finished = grown("request_success_total.length") + grown("request_success_total.stop")
    client_ttft = report["time_to_first_token_ms"]["successful"]["mean"] / 1e3
    server_ttft = server_mean("time_to_first_token_seconds")
    rows = [
        ("requests that succeeded", totals["successful"], finished, totals["successful"] == finished),
        ("requests refused or failed", totals["errored"] + totals["incomplete"], rejected,
         totals["errored"] + totals["incomplete"] == rejected == 0),
        ("prompt tokens", total("prompt_token_count"), grown("prompt_tokens_total"),
         total("prompt_token_count") == grown("prompt_tokens_total")),
        ("output tokens", total("output_token_count"), grown("generation_tokens_total"),
         total("output_token_count") == grown("generation_tokens_total")),
        ("mean TTFT (s), client >= server", client_ttft, server_ttft, client_ttft >= server_ttft),
        ("mean inter-token latency (s)", report["inter_token_latency_ms"]["successful"]["mean"] / 1e3,
         server_mean("inter_token_latency_seconds"), True),  # shown, not checked: chunks may merge
    ]
    return rows, {what: {"guidellm": g, "server": s, "agree": ok} for what, g, s, ok in rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--guidellm", default=os.environ.get("GUIDELLM") or shutil.which("guidellm"),
                        help="guidellm's executable (default: $GUIDELLM, else on PATH)")
    parser.add_argument("--model", default="smollm2-135m", help="what the server loads (default "
                        "%(default)s); it must carry a tokenizer")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--streams", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("guidellm-check"))
    args = parser.parse_args(argv)
    if not args.guidellm:
        print("error: guidellm not found: install it in a venv of its own and pass --guidellm",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer = tokenizer_folder(args.model, Path(scratch))
            with serve_in_background(args.model, served_model_name="minillm-bench",
                                     num_kv_blocks=args.num_kv_blocks, block_size=16,
                                     max_model_len=args.prompt_tokens + args.output_tokens + 64,
                                     startup_timeout=STARTUP_TIMEOUT_S) as server:
                before = scrape(server.url)
                report = run_guidellm(args.guidellm, server, tokenizer, args,
                                      args.out / "guidellm.json")
                after = scrape(server.url)
    except (ValueError, RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows, numbers = compare(report, before, after)
    (args.out / "comparison.json").write_text(json.dumps(numbers, indent=1))
    print(f"guidellm against minillm ({args.model}), {args.requests} requests, {args.streams} at once")
    for what, theirs, ours, ok in rows:
        print(f"  {what:<34} guidellm {theirs:>12.4g}   /metrics {ours:>12.4g}   {'ok' if ok else 'DIFFER'}")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
