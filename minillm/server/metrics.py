"""What the server exports at ``GET /metrics`` (chapter: serving over HTTP).

vLLM's metric names under a ``minillm:`` prefix, in Prometheus' text format, so a dashboard or the
load generator reads minillm and vLLM alike. Gauges say how things stand now (requests running and
waiting, the share of KV blocks held); counters add up the engine's run counters (preemptions,
prompt and generated tokens, prefix-cache queries and hits, finished requests by reason);
histograms hold every finished request's TTFT, its gaps between tokens, its end-to-end latency and
its time in the queue.

:meth:`ServerMetrics.observe` feeds them after every engine step from the numbers' owners: the
scheduler's queues, the KV manager, the recorder's counters and the finished requests'
``RequestMetrics``. The recorder then starts over, so a server that runs for weeks keeps no step log.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

PREFIX = "minillm:"
FINISH_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # vLLM's
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST

disable_created_metrics()  # no "<counter>_created" series: vLLM exports none either


class ServerMetrics:
    """The server's Prometheus collectors, in a registry of their own, labelled with the model name."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, **label).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, **label).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, buckets=buckets, **label).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests holding KV blocks.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Share of the KV blocks held (1 = full).")
        self.num_preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (recomputed included).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens the prefix cache served.")
        success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Gap between consecutive output tokens.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    TTFT_BUCKETS)

    def observe(self, engine) -> None:
        """Read the engine's queues and pool, take its recorder's counts since the last call and
        its finished requests, then reset the recorder. Call it only between steps."""
        scheduler, kv = engine.scheduler, engine.kv_cache.manager
        self.num_requests_running.set(len(scheduler.running))
        self.num_requests_waiting.set(len(scheduler.waiting))
        self.kv_cache_usage.set(kv.num_used_blocks / kv.num_blocks)
        recorder = engine.recorder
        self.num_preemptions.inc(recorder.num_preemptions)
        self.prompt_tokens.inc(recorder.prompt_tokens)
        self.generation_tokens.inc(recorder.generation_tokens)
        self.prefix_cache_queries.inc(recorder.prefix_cache_queries)
        self.prefix_cache_hits.inc(recorder.prefix_cache_hits)
        for request in recorder.finished:
            self.request_success[request.finish_reason].inc()
            metrics = request.metrics
            for histogram, value in ((self.ttft, metrics.ttft), (self.e2e, metrics.e2e),
                                     (self.queue_time, metrics.queueing)):
                if value is not None:
                    histogram.observe(value)
            for earlier, later in zip(metrics.token_times, metrics.token_times[1:]):
                self.tpot.observe(later - earlier)
        engine.reset_metrics()

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)
