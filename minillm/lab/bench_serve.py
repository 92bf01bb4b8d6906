"""What the HTTP server costs over the engine (chapter: serving over HTTP).

``python -m minillm bench serve`` runs the same requests two ways in one run: offline through
``LLM.generate``, and online through ``python -m minillm serve`` (a subprocess) under the load
generator (this process). It prints two comparisons:

- **throughput**: output tokens per second with all requests arriving at once, the server's over
  the offline engine's (the target: at least 0.9);
- **TTFT**: what HTTP, the event loop and streaming add to the time to first token (the target:
  at most 5 ms on the median). Requests go one at a time, each to an idle engine, in pairs: the
  offline engine, then the server, request by request, so that a busy moment of a shared machine
  lands on both sides of a pair; the median is over the pairs' differences. Beside it, from the
  same served requests, the clients' mean TTFT over the mean the engine inside the server measured
  (arrival at the handler to its first token): the same question without a second engine.

The engine gets ``threads`` CPU threads on both sides (default 1): on a small CPU the HTTP front
end and the load generator then have a core of their own, as they do beside a GPU, and the numbers
measure the server rather than two programs fighting over two cores. The burst runs ``repeats``
times per side, the two sides taking turns, and each side keeps its best run; the TTFT pairs of
all ``repeats`` rounds are pooled. Weights are random: neither number depends on their values.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from minillm.engine.device import resolve_device
from minillm.engine.llm import LLM
from minillm.engine.loader import torch_dtype
from minillm.engine.units import ceil_div
from minillm.lab import loadgen
from minillm.lab.bench_cli import add_options, report
from minillm.lab.workload import Workload
from minillm.server.launcher import serve_in_background

THROUGHPUT_TARGET = 0.9  # server tok/s over offline tok/s, at least
TTFT_TARGET_S = 0.005  # added to the median TTFT, at most


def bench_serve(model: str = "small", device=None, dtype=None, num_requests: int = 32,
                input_len: int = 128, output_len: int = 32, latency_requests: int = 16,
                latency_input_len: int = 32, latency_output_len: int = 4, repeats: int = 3,
                threads: int | None = 1, block_size: int = 16, max_num_seqs: int = 256,
                max_num_batched_tokens: int = 2048, seed: int = 0) -> dict:
    """Offline and served runs of a burst (throughput) and of requests one at a time (TTFT);
    returns every run and the two comparisons. ``model``: a preset or a folder with config.json;
    ``dtype``: a name (``"float32"``); ``threads``: the engine's CPU threads on both sides (None:
    torch's default)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = resolve_device(device)
    with torch_threads(threads):
        llm = LLM(model, device=device, dtype=torch_dtype(dtype), weights="random",
                  block_size=block_size, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens,
                  num_kv_blocks=num_requests * ceil_div(input_len + output_len, block_size) + 16)
        vocab = llm.model.config.vocab_size

        def burst(run: int) -> Workload:  # fresh prompts each run: no prefix-cache hits
            return loadgen.serving_workload("burst", vocab, num_requests, input_len, output_len,
                                            seed=seed + 2 * run)

        def one_by_one(run: int) -> Workload:  # sent one at a time: each finds the engine idle
            return loadgen.serving_workload("burst", vocab, latency_requests, latency_input_len,
                                            latency_output_len, seed=seed + 2 * run + 1)

        runs = {"offline": {"throughput": []}, "server": {"throughput": []}, "ttft_pairs": []}
        load_before, cpu_threads = os.getloadavg()[0], torch.get_num_threads()
        with serve_in_background(model, env={"OMP_NUM_THREADS": str(cpu_threads)},
                                 weights="random", device=str(device), dtype=dtype,
                                 num_kv_blocks=llm.config.num_kv_blocks, block_size=block_size,
                                 max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens) as server:
            _offline(llm, burst(0))  # untimed: first runs pay for fresh memory
            _served(server.url, burst(0))
            _ttft_pairs(llm, server.url, one_by_one(0))
            for run in range(1, repeats + 1):
                runs["offline"]["throughput"].append(_offline(llm, burst(run)))
                runs["server"]["throughput"].append(_served(server.url, burst(run)))
                runs["ttft_pairs"] += _ttft_pairs(llm, server.url, one_by_one(run))
    best_tps = {side: max(r["output_throughput"] for r in runs[side]["throughput"])
                for side in ("offline", "server")}
    pairs = runs["ttft_pairs"]
    return {
        "model": llm.model.config.name, "device": str(device),
        "dtype": str(llm.model.dtype).removeprefix("torch."), "cpu_threads": cpu_threads,
        "load_average": [load_before, os.getloadavg()[0]],
        "burst": {"num_requests": num_requests, "input_len": input_len, "output_len": output_len},
        "one_by_one": {"num_requests": latency_requests, "input_len": latency_input_len,
                       "output_len": latency_output_len, "rounds": repeats},
        "runs": runs,
        "offline_output_throughput": best_tps["offline"],
        "server_output_throughput": best_tps["server"],
        "throughput_ratio": best_tps["server"] / best_tps["offline"],
        "offline_median_ttft_s": statistics.median(p["offline_s"] for p in pairs),
        "server_median_ttft_s": statistics.median(p["server_s"] for p in pairs),
        "added_median_ttft_s": statistics.median(p["server_s"] - p["offline_s"] for p in pairs),
        "added_mean_ttft_in_run_s": statistics.fmean(p["server_s"] - p["engine_s"] for p in pairs),
    }


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's CPU threads set to ``threads`` inside the block (None: left as they are)."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1 or None, got {threads}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _offline(llm: LLM, workload: Workload) -> dict:
    """One offline run: output tokens per second (first arrival to last finish) and median TTFT."""
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, workload.params, use_tqdm=False,
                           arrival_times=workload.arrival_times)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "output_throughput": tokens / seconds,
            "median_ttft_s": statistics.median(o.metrics.ttft for o in outputs)}


def _ttft_pairs(llm: LLM, url: str, workload: Workload) -> list[dict]:
    """Each request alone, offline and then through the server: its TTFT on both sides, and the
    TTFT the engine inside the server measured for it."""
    pairs = []
    for i in range(len(workload)):
        alone = Workload(workload.name, workload.prompts[i:i + 1], workload.params[i:i + 1], [0.0])
        offline, served = _offline(llm, alone), _served(url, alone)
        pairs.append({"offline_s": offline["median_ttft_s"], "server_s": served["median_ttft_s"],
                      "engine_s": served["engine_mean_ttft_s"]})
    return pairs


def _served(url: str, workload: Workload) -> dict:
    """One run through the server: the same numbers as the clients saw them, and the mean TTFT
    of the engine inside the server over the same requests (its Prometheus histogram)."""
    record = loadgen.run_load(url, workload, progress=False, sample_interval=None)
    summary = record["summary"]
    if summary["num_completed"] != len(workload):
        raise RuntimeError(f"the server completed {summary['num_completed']} of {len(workload)} "
                           f"requests ({summary['errors_by_status']})")
    return {"seconds": summary["duration_s"], "output_tokens": summary["output_tokens"],
            "output_throughput": summary["output_throughput"],
            "median_ttft_s": summary["ttft"]["p50"], "mean_ttft_s": summary["ttft"]["mean"],
            "engine_mean_ttft_s": loadgen.server_mean(record, "time_to_first_token_seconds")}


def format_serve(result: dict) -> str:
    burst, one_by_one = result["burst"], result["one_by_one"]
    ratio, added = result["throughput_ratio"], result["added_median_ttft_s"]
    rows = [
        ("", "offline LLM.generate", "server + loadgen", "server vs offline"),
        (f"output tok/s, {burst['num_requests']} at once",
         f"{result['offline_output_throughput']:,.1f}", f"{result['server_output_throughput']:,.1f}",
         f"x{ratio:.3f} ({'meets' if ratio >= THROUGHPUT_TARGET else 'misses'} >= {THROUGHPUT_TARGET})"),
        (f"median TTFT, {one_by_one['num_requests']} x {one_by_one['rounds']} alone, paired",
         f"{result['offline_median_ttft_s'] * 1e3:,.2f} ms", f"{result['server_median_ttft_s'] * 1e3:,.2f} ms",
         f"{added * 1e3:+,.2f} ms median of pairs ({'meets' if added <= TTFT_TARGET_S else 'misses'} "
         f"<= {TTFT_TARGET_S * 1e3:g} ms)"),
        ("mean TTFT, same served requests", "", "",
         f"{result['added_mean_ttft_in_run_s'] * 1e3:+,.2f} ms over the engine's own (its histogram)")]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"bench serve: {result['model']} (random weights) on {result['device']}, "
             f"{result['dtype']}, {result['cpu_threads']} threads; load average "
             f"{result['load_average'][0]:.2f} before, {result['load_average'][1]:.2f} after; "
             f"throughput: best of {len(result['runs']['server']['throughput'])} runs per side"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def add_cli(bench_commands) -> None:
    """Register ``serve`` on the ``bench`` subcommands."""
    cmd = bench_commands.add_parser("serve", help="the HTTP server against the offline engine: "
                                                  "throughput ratio and added TTFT")
    add_options(cmd, model="small", threads=False)  # its own --threads: the labs' policy by default
    cmd.add_argument("--num-requests", type=int, default=32, help="the burst (throughput)")
    cmd.add_argument("--input-len", type=int, default=128)
    cmd.add_argument("--output-len", type=int, default=32)
    cmd.add_argument("--latency-requests", type=int, default=16,
                     help="sent one at a time, offline and served in turns (TTFT), per round")
    cmd.add_argument("--latency-input-len", type=int, default=32)
    cmd.add_argument("--latency-output-len", type=int, default=4)
    cmd.add_argument("--repeats", type=int, default=3,
                     help="burst runs per side (best kept) and TTFT rounds (pooled)")
    cmd.add_argument("--threads", type=int, default=1, help="the engine's CPU threads on both sides "
                                                          "(default 1: a core left for HTTP and the clients)")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Print both comparisons; write the record if ``--out``."""
    params = {k: getattr(args, k) for k in ("model", "dtype", "num_requests", "input_len", "output_len",
                                            "latency_requests", "latency_input_len", "latency_output_len",
                                            "repeats", "threads", "seed")}
    return report(args, "serve", params, lambda device: bench_serve(
        args.model, device, args.dtype, args.num_requests, args.input_len, args.output_len,
        args.latency_requests, args.latency_input_len, args.latency_output_len, args.repeats, args.threads,
        seed=args.seed), format_serve)
