"""What a user feels and what the operator pays for (chapters 一次请求的一生 and 调度).

Per request: TTFT (arrival -> first token), TPOT (mean gap between later tokens), the longest gap
between two tokens, end-to-end time and queueing time (arrival -> first scheduled). Per run:
percentiles of those, throughput in output and in total tokens per second, and goodput: requests
per second that met a latency SLO. All times are seconds on one clock: the engine's for its
``RequestMetrics``, the client's for the load generator's ``ClientRequest``; :func:`summarize`
reads either kind.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minillm.engine.request import RequestMetrics

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "max_itl", "e2e", "queueing")  # per request; None where not seen


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


def goodput(requests: list, slo: SLO, duration: float | None = None) -> float:
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


def summarize(requests: list, slo: SLO | None = None, duration: float | None = None) -> dict:
    """The run in one dictionary: counts, throughput, latency distributions and (with an SLO)
    goodput. ``requests``: the engine's ``RequestMetrics`` or the load generator's
    ``ClientRequest``, anything with ``num_prompt_tokens``, ``num_output_tokens``, ``completed``
    and the :data:`LATENCIES` (None where that side cannot see one). Tokens count over every
    request, latencies and the request rate over the completed ones. ``duration`` defaults to first
    arrival -> last finish (engine requests only)."""
    duration = run_duration(requests) if duration is None else duration
    if not duration > 0:
        raise ValueError(f"duration must be positive, got {duration}")
    completed = [r for r in requests if r.completed]
    output_tokens = sum(r.num_output_tokens for r in requests)
    prompt_tokens = sum(r.num_prompt_tokens or 0 for r in requests)
    summary = {
        "num_requests": len(requests),
        "num_completed": len(completed),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(completed) / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (prompt_tokens + output_tokens) / duration,
    }
    for name in LATENCIES:
        summary[name] = distribution([v for r in completed if (v := getattr(r, name)) is not None])
    if slo is not None:
        summary["slo"] = {"ttft": slo.ttft, "tpot": slo.tpot}
        summary["goodput"] = goodput(completed, slo, duration)
        summary["slo_attainment"] = sum(slo.met_by(r) for r in completed) / len(requests)
    return summary
