"""What a user feels and what the operator pays for (chapters 一次请求的一生 and 调度).

Per request: TTFT (arrival -> first token), TPOT (mean gap between later tokens), end-to-end time
and queueing time (arrival -> first scheduled). Per run: percentiles of those, throughput in output
and in total tokens per second, and goodput: requests per second that met a latency SLO.
All times are seconds on one clock (the engine's); the timestamps are ``RequestMetrics``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minillm.engine.request import RequestMetrics

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """A latency target: first token within ``ttft`` seconds, then one token every ``tpot`` seconds."""

    ttft: float
    tpot: float

    def __post_init__(self):
        for name in ("ttft", "tpot"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SLO {name} must be a positive number of seconds, "
                                 f"got {getattr(self, name)}")

    def met_by(self, metrics: RequestMetrics) -> bool:
        """A finished request meets the SLO; a single-token answer has no TPOT to miss."""
        if metrics.ttft is None or metrics.ttft > self.ttft:
            return False
        return metrics.tpot is None or metrics.tpot <= self.tpot


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics (numpy's rule)."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float] | None:
    """Mean and the standard percentiles (p50, p90, p99) of a list; None when it is empty."""
    if not values:
        return None
    return {"mean": sum(values) / len(values),
            **{f"p{q}": percentile(values, q) for q in PERCENTILES}}


def goodput(requests: list[RequestMetrics], slo: SLO, duration: float | None = None) -> float:
    """Requests per second that met ``slo`` over the run's duration (default: first arrival to
    last finish)."""
    duration = run_duration(requests) if duration is None else duration
    return sum(slo.met_by(m) for m in requests) / duration


def run_duration(requests: list[RequestMetrics]) -> float:
    """First arrival to last finish."""
    finished = [m.finish_time for m in requests if m.finish_time is not None]
    if not finished:
        raise ValueError("no finished request: the run has no duration")
    return max(finished) - min(m.arrival_time for m in requests)


def summarize(requests: list[RequestMetrics], slo: SLO | None = None,
              duration: float | None = None) -> dict:
    """The run in one dictionary: counts, throughput, latency distributions and (with an SLO)
    goodput. ``duration`` defaults to first arrival -> last finish."""
    duration = run_duration(requests) if duration is None else duration
    if not duration > 0:
        raise ValueError(f"duration must be positive, got {duration}")
    output_tokens = sum(m.num_output_tokens for m in requests)
    prompt_tokens = sum(m.num_prompt_tokens for m in requests)
    summary = {
        "num_requests": len(requests),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(requests) / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (prompt_tokens + output_tokens) / duration,
    }
    for name in ("ttft", "tpot", "e2e", "queueing"):
        summary[name] = distribution([v for m in requests if (v := getattr(m, name)) is not None])
    if slo is not None:
        summary["slo"] = {"ttft": slo.ttft, "tpot": slo.tpot}
        summary["goodput"] = goodput(requests, slo, duration)
        summary["slo_attainment"] = sum(slo.met_by(m) for m in requests) / len(requests)
    return summary
