"""Real traffic against a server (chapters 一次请求的一生 and serving over HTTP).

``python -m minillm loadgen --url http://127.0.0.1:8000 --workload twenty-colleagues`` sends
streaming completions on a schedule and measures what each client sees: the time to its first
token (TTFT), the time per token after it (TPOT), the end-to-end time, tokens per second and the
errors. It speaks only the OpenAI API (with vLLM's ``ignore_eos``), so it measures vLLM on a GPU
the way it measures minillm on a laptop. When the server exports Prometheus metrics (``minillm:``
or ``vllm:`` names) it also reads the counters before and after the run and samples the gauges
(requests running and waiting, KV use) during it. The result is a client run record
(``minillm.lab.records``) that ``python -m minillm diagnose`` reads.

Workloads (made by ``minillm.lab.workload``; prompts are random token ids, or words):

- ``twenty-colleagues``: chapter 1's office. Twenty people at once (or at ``rate`` per second);
  one pastes an 8K-token contract, the others ask short questions.
- ``poisson``: chat-like lengths (lognormal) arriving as a Poisson process at ``rate`` per second.
- ``burst``: ``num_requests`` requests of the same lengths, all at once.
"""
from __future__ import annotations

import asyncio
import json
import math
import platform
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone

from minillm.engine.llm import progress_bar
from minillm.engine.units import fmt_or_dash, fmt_seconds
from minillm.lab import records
from minillm.engine.request import inter_token_latencies, time_per_output_token
from minillm.lab.metrics import summarize
from minillm.lab.workload import Workload, chat_workload, contract_workload, make_workload

WORKLOADS = ("twenty-colleagues", "poisson", "burst")
DEFAULT_VOCAB = 1000  # random prompt ids below this exist in every real vocabulary
WORDS = ("the", "time", "people", "way", "day", "man", "thing", "world", "life", "hand", "part",
         "place", "case", "week", "work", "number", "group", "problem", "fact", "good", "new",
         "first", "last", "long", "great", "little", "own", "other", "old", "right", "big", "high")
METRIC_PREFIXES = ("minillm", "vllm")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
            "prefix_cache_queries_total", "prefix_cache_hits_total",
            "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
            "inter_token_latency_seconds_sum", "inter_token_latency_seconds_count",
            "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
            "request_queue_time_seconds_sum", "request_queue_time_seconds_count")
ALIASES = {"gpu_cache_usage_perc": "kv_cache_usage_perc"}  # vLLM's name before V1


def serving_workload(name: str, vocab_size: int = DEFAULT_VOCAB, num_requests: int | None = None,
                     input_len: int | None = None, output_len: int | None = None,
                     contract_len: int = 8192, rate: float | None = None, seed: int = 0) -> Workload:
    """One of :data:`WORKLOADS`; ``None`` settings take the workload's defaults."""
    if name == "twenty-colleagues":
        workload = contract_workload(vocab_size, num_requests or 20, contract_len, (16, 128),
                                     output_len or 64, rate=rate or math.inf, seed=seed)
    elif name == "poisson":
        workload = chat_workload(num_requests or 100, vocab_size, input_median=input_len or 256,
                                 output_median=output_len or 128, rate=rate or 1.0, seed=seed)
    elif name == "burst":
        count = num_requests or 64
        workload = make_workload(name, [input_len or 256] * count, [output_len or 128] * count,
                                 vocab_size, seed=seed)
    else:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    return replace(workload, name=name)


@dataclass
class ClientRequest:
    """What one client saw; times in seconds."""

    index: int
    start: float  # when it was sent, after the run's start
    num_prompt_tokens: int | None  # the server's count (usage), else the ids sent
    num_output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None  # sent to the last byte
    finish_reason: str | None = None  # "stop" | "length" | "abort" (the server's word)
    error: dict | None = None  # {"status": HTTP status or None, "message": ...}
    hung_up: bool = False  # the client closed the stream on purpose (``hangup_share``)
    max_itl: float | None = None  # the longest wait between two tokens: a stall the reader sees

    @property
    def completed(self) -> bool:
        """Answered to the end: no error, not hung up, finished by "stop" or "length"."""
        return self.error is None and not self.hung_up and self.finish_reason in ("stop", "length")

    @property
    def queueing(self) -> None:
        """A client cannot see the server's queue (its histogram says it: ``server_mean``)."""
        return None


# --- one run --------------------------------------------------------------------------------------

def run_load(url: str, workload: Workload, **options) -> dict:
    """:func:`run_load_async`, blocking; in a notebook its event loop runs in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_load_async(url, workload, **options))
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run_load_async(url, workload, **options)).result()


async def run_load_async(url: str, workload: Workload, *, model: str | None = None,
                         api_key: str | None = None, text_prompts: bool = False,
                         hangup_share: float = 0.0, sample_interval: float | None = 0.5,
                         progress: bool = True, seed: int = 0, timeout: float = 600.0) -> dict:
    """Send ``workload`` to the server at ``url`` as streaming completions, each at its arrival
    time; return the client run record. ``model``: default the server's first. ``text_prompts``:
    words instead of token ids. ``hangup_share``: the share of clients that hang up mid-stream.
    ``sample_interval``: seconds between samples of the server's gauges (None: no sampling, only
    the counters before and after, so that no scrape competes with the requests)."""
    import httpx

    if not 0 <= hangup_share <= 1:
        raise ValueError(f"hangup_share must be in [0, 1], got {hangup_share}")
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        served = await _served_model(client, url, model)
        _check_fits(workload, served.get("max_model_len"))
        bodies = _bodies(workload, served["id"], text_prompts, seed)
        rng = random.Random(seed)
        hang_ups = [rng.randint(1, max(1, p.max_tokens - 1)) if rng.random() < hangup_share else None
                    for p in workload.params]
        backend, before = await _scrape(client, url)
        bar = progress_bar(len(workload), progress, "loadgen")
        t0 = time.perf_counter()
        samples: list[dict] = []
        sampler = asyncio.ensure_future(_sample(client, url, t0, sample_interval, samples)) \
            if backend and sample_interval else None
        sends = [_send(client, url + "/v1/completions", body, i, t0 + workload.arrival_times[i],
                       t0, hang_ups[i], bar) for i, body in enumerate(bodies)]
        results = await asyncio.gather(*sends)
        if sampler is not None:
            sampler.cancel()
        bar.close()
        _, after = await _scrape(client, url)
    duration = max(r.start + (r.e2e or 0.0) for r in results) - min(r.start for r in results)
    server_metrics = None
    if backend:
        server_metrics = {"before": before, "after": after, "samples": samples,
                          "delta": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after
                                    if k not in GAUGES}}
    return {
        "format": records.CLIENT_RUN_FORMAT, "version": 1,
        "server": {"url": url, "model": served["id"], "backend": backend,
                   "max_model_len": served.get("max_model_len")},
        "workload": {"name": workload.name, "num_requests": len(workload),
                     "input_lens": workload.input_lens, "output_lens": workload.output_lens,
                     "arrival_times": workload.arrival_times,
                     "prompts": "text" if text_prompts else "token ids",
                     "hangup_share": hangup_share, "seed": seed},
        "client": {"python": platform.python_version(), "httpx": httpx.__version__,
                   "git_commit": records.git_commit(),
                   "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "duration_s": duration,
        "requests": [asdict(r) for r in results],
        "server_metrics": server_metrics,
        "summary": summarize_clients(results, duration),
    }


async def _served_model(client, url: str, model: str | None) -> dict:
    """The server's entry in ``/v1/models`` for ``model`` (default: its first)."""
    import httpx

    try:
        response = await client.get(url + "/v1/models")
    except httpx.HTTPError as err:
        raise ValueError(f"cannot reach the server at {url}: {type(err).__name__}: {err}") from None
    if response.status_code != 200:
        raise ValueError(f"{url}/v1/models answered {response.status_code}: "
                         f"{_error_message(response.content)}")
    served = response.json()["data"]
    if model is None:
        return served[0]
    for entry in served:
        if entry["id"] == model:
            return entry
    raise ValueError(f"the server does not serve {model!r}; it serves {[e['id'] for e in served]}")


def _check_fits(workload: Workload, max_model_len: int | None) -> None:
    longest = max(i + o for i, o in zip(workload.input_lens, workload.output_lens))
    if max_model_len is not None and longest > max_model_len:
        raise ValueError(f"the workload's longest request needs {longest} tokens (prompt + "
                         f"max_tokens) but the server's max_model_len is {max_model_len}: shorten "
                         f"the prompts or outputs, or serve a longer max_model_len")


def _bodies(workload: Workload, model: str, text_prompts: bool, seed: int) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for prompt, params in zip(workload.prompts, workload.params):
        bodies.append({
            "model": model,
            "prompt": " ".join(rng.choice(WORDS) for _ in prompt) if text_prompts else prompt,
            "max_tokens": params.max_tokens, "temperature": params.temperature,
            "ignore_eos": params.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True})
    return bodies


async def _send(client, url: str, body: dict, index: int, send_at: float, t0: float,
                hang_up_after: int | None, bar) -> ClientRequest:
    """One streaming request, sent at ``send_at`` (perf_counter), as its client saw it."""
    import httpx

    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    sent = time.perf_counter()
    prompt = body["prompt"]
    result = ClientRequest(index, sent - t0, len(prompt) if isinstance(prompt, list) else None)
    token_times: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = {"status": response.status_code,
                                "message": _error_message(await response.aread())}
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = {"status": event["error"].get("code"),
                                        "message": event["error"].get("message")}
                        break
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        ids = choice.get("token_ids")  # else one token per chunk with text
                        count = len(ids) if ids is not None else int(bool(choice.get("text")))
                        token_times += [time.perf_counter()] * count
                        result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    if hang_up_after is not None and len(token_times) >= hang_up_after:
                        result.hung_up = True
                        break
    except httpx.HTTPError as err:
        result.error = {"status": None, "message": f"{type(err).__name__}: {err}"}
    result.e2e = time.perf_counter() - sent
    result.num_output_tokens = usage["completion_tokens"] if usage else len(token_times)
    if usage:
        result.num_prompt_tokens = usage["prompt_tokens"]
    if token_times:
        result.ttft = token_times[0] - sent
        result.tpot = time_per_output_token(token_times[0], token_times[-1], result.num_output_tokens)
        result.max_itl = max(inter_token_latencies(token_times), default=None)
    bar.update(1)
    return result


def _error_message(content: bytes) -> str:
    try:
        return json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return content.decode(errors="replace")[:200]


# --- the server's own numbers ---------------------------------------------------------------------

def parse_metrics(text: str) -> tuple[str | None, dict[str, float]]:
    """The Prometheus text of a minillm or vLLM server as (prefix, {name: value}): the gauges and
    counters the record keeps, summed over labels; finished requests as
    ``request_success_total.<reason>``, minillm's refused ones as ``request_rejected_total.<reason>``."""
    from prometheus_client.parser import text_string_to_metric_families

    backend, values = None, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            prefix, colon, name = sample.name.partition(":")
            if not colon or prefix not in METRIC_PREFIXES:
                continue
            backend = prefix
            name = ALIASES.get(name, name)
            if name == "request_success_total":
                name = f"{name}.{sample.labels.get('finished_reason', '')}"
            elif name == "request_rejected_total":
                name = f"{name}.{sample.labels.get('reason', '')}"
            elif name not in GAUGES + COUNTERS:
                continue
            values[name] = values.get(name, 0.0) + sample.value
    return backend, values


async def _scrape(client, url: str) -> tuple[str | None, dict[str, float]]:
    """``parse_metrics`` of the server's ``/metrics``; (None, {}) when it has none."""
    import httpx

    try:
        response = await client.get(url + "/metrics")
    except httpx.HTTPError:
        return None, {}
    if response.status_code != 200:
        return None, {}
    try:
        return parse_metrics(response.text)
    except ValueError:
        return None, {}


async def _sample(client, url: str, t0: float, interval: float, samples: list[dict]) -> None:
    """The gauges every ``interval`` seconds, appended to ``samples`` until cancelled."""
    while True:
        _, values = await _scrape(client, url)
        samples.append({"t": time.perf_counter() - t0, **{g: values.get(g) for g in GAUGES}})
        await asyncio.sleep(interval)


# --- the summary ----------------------------------------------------------------------------------

def server_mean(record: dict, histogram: str) -> float | None:
    """The mean of one of the server's latency histograms over a run (``histogram`` without its
    prefix): the growth of its ``_sum`` over that of its ``_count``; None when the server exported
    no metrics or counted nothing."""
    delta = (record["server_metrics"] or {}).get("delta", {})
    count = delta.get(f"{histogram}_count", 0)
    return delta[f"{histogram}_sum"] / count if count else None


def summarize_clients(requests: list[ClientRequest], duration: float) -> dict:
    """``minillm.lab.metrics.summarize`` of what the clients saw, with what only a client sees:
    errors by HTTP status, requests the server aborted, clients that hung up."""
    return {
        **summarize(requests, duration=duration),
        "num_errors": sum(r.error is not None for r in requests),
        "num_aborted": sum(r.finish_reason == "abort" and not r.hung_up and r.error is None
                           for r in requests),
        "num_hung_up": sum(r.hung_up for r in requests),
        "errors_by_status": dict(Counter(str(r.error["status"]) for r in requests if r.error)),
    }


def format_report(record: dict) -> str:
    """The run in a few lines: what the clients saw and, if scraped, what the server counted."""
    s, server = record["summary"], record["server"]
    lines = [f"loadgen: {record['workload']['name']}, {s['num_requests']} requests to "
             f"{server['url']} ({server['model']}, {server['backend'] or 'no /metrics'})",
             f"  completed {s['num_completed']}, errors {s['num_errors']}"
             + (f" {s['errors_by_status']}" if s["errors_by_status"] else "")
             + f", aborted by the server {s['num_aborted']}, hung up {s['num_hung_up']}",
             f"  {s['duration_s']:.2f} s: {s['output_tokens']:,} output tokens = "
             f"{s['output_throughput'] or 0:,.1f} tok/s, {s['request_throughput'] or 0:.2f} req/s"]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("max_itl", "worst gap"),
                        ("e2e", "end-to-end")):
        d = s[name]
        lines.append(f"  {label:<10} " + ("-" if d is None else
                     "  ".join(f"{k} {fmt_seconds(d[k])}" for k in ("mean", "p50", "p90", "p99"))))
    metrics = record["server_metrics"]
    if metrics:
        delta, samples = metrics["delta"], metrics["samples"]
        peak = {g: max((x[g] for x in samples if x[g] is not None), default=None) for g in GAUGES}
        lines.append(f"  server: preemptions +{delta.get('num_preemptions_total', 0):.0f}, peak KV "
                     f"use {fmt_or_dash(peak['kv_cache_usage_perc'], '.0%')}, peak waiting "
                     f"{fmt_or_dash(peak['num_requests_waiting'], '.0f')}, peak running "
                     f"{fmt_or_dash(peak['num_requests_running'], '.0f')}")
    return "\n".join(lines)


def add_cli(subparsers) -> None:
    """Register ``loadgen`` on the ``python -m minillm`` subparsers."""
    cmd = subparsers.add_parser("loadgen", help="streaming traffic against an OpenAI-compatible "
                                                "server; writes a client run record")
    cmd.add_argument("--url", default="http://127.0.0.1:8000", help="the server (minillm or vLLM)")
    cmd.add_argument("--workload", choices=WORKLOADS, default="twenty-colleagues")
    cmd.add_argument("--num-requests", type=int, help="default 20 / 100 / 64 by workload")
    cmd.add_argument("--input-len", type=int, help="prompt tokens (poisson: the median)")
    cmd.add_argument("--output-len", type=int, help="output tokens (poisson: the median)")
    cmd.add_argument("--contract-len", type=int, default=8192, help="twenty-colleagues: the contract")
    cmd.add_argument("--rate", type=float, help="requests per second (default: all at once; poisson 1)")
    cmd.add_argument("--model", help="the served model name (default: the server's first)")
    cmd.add_argument("--api-key")
    cmd.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                     help=f"random prompt ids are below this (default {DEFAULT_VOCAB})")
    cmd.add_argument("--text-prompts", action="store_true", help="words instead of token ids")
    cmd.add_argument("--hangup-share", type=float, default=0.0,
                     help="share of clients that hang up mid-stream (default 0)")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--out", default="loadgen-run.json", help="the client run record (JSON)")
    cmd.add_argument("--no-progress", action="store_true")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Run, print the report, write the record; exit code 2 with a one-line reason."""
    try:
        workload = serving_workload(args.workload, args.vocab_size, args.num_requests,
                                    args.input_len, args.output_len, args.contract_len, args.rate,
                                    args.seed)
        record = run_load(args.url, workload, model=args.model, api_key=args.api_key,
                          text_prompts=args.text_prompts, hangup_share=args.hangup_share,
                          progress=not args.no_progress, seed=args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_report(record))
    records.save_client_run(record, args.out)
    print(f"record written to {args.out} (python -m minillm diagnose {args.out})")
    return 0
