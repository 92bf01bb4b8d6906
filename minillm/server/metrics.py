"""What the server exports at ``GET /metrics`` (chapter: serving over HTTP).

vLLM's (V1) metric names and meanings under a ``minillm:`` prefix, in Prometheus' text format, so
a dashboard or the load generator reads minillm and vLLM alike:

- gauges, how things stand now: ``num_requests_running``, ``num_requests_waiting``,
  ``kv_cache_usage_perc`` (share of KV blocks held);
- counters since the server started: ``num_preemptions``, ``prompt_tokens`` (each request's prompt
  once, prefix hits included, as vLLM V1 counts it; recomputation after a preemption is not
  counted again), ``generation_tokens``, the speculative decoding counters ``spec_decode_num_drafts``,
  ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
  ``spec_decode_num_accepted_tokens_per_pos`` by ``position`` (one series per proposal position), ``prefix_cache_queries`` and ``prefix_cache_hits`` (in
  tokens), ``request_success`` by ``finished_reason``, and ``request_rejected`` by ``reason``
  (minillm's own: every error answer, also written to the log with its reason);
- histograms: ``time_to_first_token_seconds`` (observed at the first token),
  ``inter_token_latency_seconds`` (every gap between two tokens of a request, as they come: the
  name vLLM gave ``time_per_output_token_seconds`` when it retired it; minillm exports only the
  new one), ``request_time_per_output_token_seconds`` (each finished request's mean TPOT),
  ``e2e_request_latency_seconds`` and ``request_queue_time_seconds`` (at the finish), and at the
  finish also ``request_prompt_tokens``, ``request_generation_tokens``,
  ``request_prefill_time_seconds`` (first scheduled to first token), ``request_decode_time_seconds``
  (first token to last) and ``request_inference_time_seconds`` (first scheduled to last token);
  ``iteration_tokens_total`` (prompt and generated tokens of each engine step: a histogram despite
  its name, as vLLM's); ``request_params_max_tokens`` and ``request_params_n`` (when a request is
  added: one choice per engine request);
- ``cache_config_info``: 1, its labels the KV cache's settings (vLLM's info metric).

The gauges and counters are read at scrape time from the engine's snapshot
(``LLMEngine.snapshot``), which the engine loop takes after every step; nothing here resets
anything in the engine. The histograms are fed from the outputs each step hands back.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minillm.engine.engine_config import EngineConfig
from minillm.engine.recorder import FINISH_REASONS
from minillm.engine.request import RequestOutput
from minillm.engine.sampling import SamplingParams

PREFIX = "minillm:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # vLLM's
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for request_params_n
CONTENT_TYPE = CONTENT_TYPE_LATEST
GAUGES = {  # name: (snapshot key, help)
    "num_requests_running": ("num_running", "Requests holding KV blocks."),
    "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("kv_usage", "Share of the KV blocks held (1 = full)."),
}
COUNTERS = {  # name (without _total): (snapshot key, help)
    "num_preemptions": ("num_preemptions", "Requests preempted to free KV blocks."),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens, each request's once (prefix hits included)."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "prefix_cache_queries": ("prefix_query_tokens", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_hit_tokens", "Prompt tokens the prefix cache served."),
    # speculative decoding (zero without speculative_config), vLLM V1's names
    "spec_decode_num_drafts": ("num_drafts", "Request steps that verified proposed tokens."),
    "spec_decode_num_draft_tokens": ("num_draft_tokens", "Proposed tokens verified."),
    "spec_decode_num_accepted_tokens": ("num_accepted_tokens", "Proposed tokens accepted."),
}

disable_created_metrics()  # no "<counter>_created" series: vLLM exports none either


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    """The server's Prometheus collectors, in a registry of their own, labelled with the model name;
    ``config`` (the engine's, resolved) sizes the token histograms and fills ``cache_config_info``."""

    def __init__(self, model_name: str, snapshot: dict, config: EngineConfig):
        self.model_name = model_name
        self.snapshot = snapshot  # the engine's, after its latest step
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(self))
        label = {"labelnames": ["model_name"], "registry": self.registry}

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, buckets=buckets, **label).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive output tokens.",
                             ITL_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Each finished request's mean time per output token after "
                                      "the first.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    TTFT_BUCKETS)
        tokens = buckets_1_2_5(config.max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished "
                                       "request.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Tokens each finished request "
                                           "generated.", tokens)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first "
                                      "token.", E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                     E2E_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last "
                                        "token.", E2E_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Prompt and generated tokens of "
                                          "each engine step.", ITERATION_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "Each request's max_tokens.",
                                           tokens)
        self.params_n = histogram("request_params_n", "Each request's n (choices per prompt).",
                                  N_BUCKETS)
        info = {"block_size": config.block_size, "num_gpu_blocks": config.num_kv_blocks,
                "num_cpu_blocks": config.num_cpu_blocks, "cache_dtype": config.kv_cache_dtype,
                "enable_prefix_caching": config.enable_prefix_caching,
                "gpu_memory_utilization": config.gpu_memory_utilization}
        Gauge(PREFIX + "cache_config_info", "The KV cache's settings (value 1).", list(info),
              registry=self.registry).labels(*map(str, info.values())).set(1)
        self._rejected = Counter(PREFIX + "request_rejected", "Requests answered with an error, by "
                                 "reason.", ["model_name", "reason"], registry=self.registry)

    def observe(self, snapshot: dict, outputs: list[RequestOutput]) -> None:
        """Keep the engine's latest snapshot; put each output's new token gaps and each finished
        request's latencies in the histograms. Call it only between steps."""
        previous, self.snapshot = self.snapshot, snapshot
        if snapshot["num_steps"] > previous["num_steps"]:
            self.iteration_tokens.observe(
                snapshot["num_prefill_tokens"] - previous["num_prefill_tokens"]
                + snapshot["generation_tokens"] - previous["generation_tokens"])
        for output in outputs:
            metrics, new = output.metrics, len(output.new_token_ids)
            times = metrics.token_times
            for i in range(len(times) - new, len(times)):
                if i == 0:
                    self.ttft.observe(metrics.ttft)
                else:
                    self.itl.observe(times[i] - times[i - 1])
            if output.finished:
                self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        metrics = output.metrics
        scheduled, first = metrics.first_scheduled_time, metrics.first_token_time
        last = metrics.token_times[-1] if metrics.token_times else None
        self.prompt_tokens.observe(metrics.num_prompt_tokens)
        self.generation_tokens.observe(metrics.num_output_tokens)
        for histogram, value in (
                (self.e2e, metrics.e2e), (self.queue_time, metrics.queueing),
                (self.request_tpot, metrics.tpot),
                (self.prefill_time, None if first is None or scheduled is None else first - scheduled),
                (self.decode_time, None if last is None else last - first),
                (self.inference_time, None if last is None or scheduled is None else last - scheduled)):
            if value is not None:
                histogram.observe(value)

    def observe_added(self, params: list[SamplingParams], ns: list[int]) -> None:
        """The parameters of client requests just added: each one's ``max_tokens`` and ``n``
        (choices per prompt)."""
        for p, n in zip(params, ns, strict=True):
            self.params_max_tokens.observe(p.max_tokens)
            self.params_n.observe(n)

    def reject(self, reason: str) -> None:
        """Count one request answered with an error (``reason``: ``APIError.reason``)."""
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)


class _SnapshotCollector:
    """The gauges and counters, read from the latest engine snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        snapshot, name = self.metrics.snapshot, self.metrics.model_name
        for metric, (key, doc) in GAUGES.items():
            family = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric([name], snapshot[key])
            yield family
        for metric, (key, doc) in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric([name], snapshot[key])
            yield family
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Proposed "
                                      "tokens accepted, by position among a request's proposals.",
                                      labels=["model_name", "position"])
        for position, count in enumerate(snapshot["num_accepted_tokens_per_pos"]):
            per_pos.add_metric([name, str(position)], count)
        yield per_pos
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests, by finish "
                                      "reason.", labels=["model_name", "finished_reason"])
        for reason in FINISH_REASONS:
            success.add_metric([name, reason], snapshot[f"num_finished_{reason}"])
        yield success
