"""TTFT, TPOT, percentiles, throughput and goodput (chapters 一次请求的一生 and 调度)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab.metrics import SLO, RequestMetrics, distribution, goodput, percentile, summarize


def finished(arrival, scheduled, token_times, prompt=10):
    return RequestMetrics(arrival, num_prompt_tokens=prompt, first_scheduled_time=scheduled,
                          first_token_time=token_times[0], token_times=list(token_times),
                          finish_time=token_times[-1])


def test_per_request_definitions():
    m = finished(1.0, 1.5, [2.0, 2.5, 3.5])
    assert m.queueing == 0.5
    assert m.ttft == 1.0
    assert m.tpot == 0.75  # (3.5 - 2.0) / 2
    assert m.e2e == 2.5
    assert m.tpot == pytest.approx((m.e2e - m.ttft) / (m.num_output_tokens - 1))
    single = finished(0.0, 0.0, [0.2])
    assert single.tpot is None and single.ttft == 0.2
    waiting = RequestMetrics(3.0)
    assert waiting.ttft is None and waiting.e2e is None and waiting.queueing is None
    assert finished(0, 0, [1, 2]).to_dict()["tpot"] == 1


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-9, abs=1e-6)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)
    assert distribution([]) is None
    assert distribution([1.0, 3.0]) == {"mean": 2.0, "p50": 2.0, "p90": 2.8,
                                        "p99": pytest.approx(2.98)}


def test_slo_and_goodput():
    slo = SLO(ttft=1.0, tpot=0.5)
    fast = finished(0.0, 0.0, [0.5, 0.9, 1.3])  # ttft 0.5, tpot 0.4
    slow_start = finished(0.0, 0.0, [1.5, 1.6])  # ttft 1.5
    slow_tokens = finished(1.0, 1.0, [1.5, 2.5, 3.5])  # tpot 1.0
    one_token = finished(2.0, 2.0, [3.0])  # no tpot, ttft exactly at the limit
    requests = [fast, slow_start, slow_tokens, one_token]
    assert [slo.met_by(m) for m in requests] == [True, False, False, True]
    assert goodput(requests, slo) == 2 / 3.5  # first arrival 0.0, last finish 3.5
    assert goodput(requests, slo, duration=4.0) == 0.5
    with pytest.raises(ValueError, match="ttft"):
        SLO(ttft=0, tpot=1)


def test_summarize_counts_throughput_and_distributions():
    requests = [finished(0.0, 0.0, [1.0, 2.0], prompt=8), finished(1.0, 2.0, [3.0, 3.5, 4.0], prompt=4)]
    summary = summarize(requests, SLO(ttft=1.5, tpot=1.0))
    assert summary["duration_s"] == 4.0
    assert summary["output_tokens"] == 5 and summary["prompt_tokens"] == 12
    assert summary["output_throughput"] == 5 / 4
    assert summary["total_throughput"] == 17 / 4
    assert summary["request_throughput"] == 0.5
    assert summary["ttft"]["mean"] == 1.5
    assert summary["queueing"]["p50"] == 0.5
    assert summary["tpot"]["p99"] == pytest.approx(0.5 + 0.99 * 0.5)
    assert summary["goodput"] == 1 / 4 and summary["slo_attainment"] == 0.5
    assert "goodput" not in summarize(requests)
    with pytest.raises(ValueError, match="no finished request"):
        summarize([RequestMetrics(0.0)])


def test_engine_and_client_requests_summarize_alike():
    """One summarize for both sides: the same keys, the same TPOT and worst gap for the same token
    times; only what a client cannot see (queueing) is missing, and only completed clients count
    in the latencies."""
    from minillm.lab.loadgen import ClientRequest

    engine = [finished(0.0, 0.5, [1.0, 1.5, 3.0], prompt=8), finished(0.0, 0.0, [2.0, 2.5], prompt=4)]
    clients = [ClientRequest(i, 0.0, m.num_prompt_tokens, m.num_output_tokens, m.ttft, m.tpot, m.e2e,
                             "length", max_itl=m.max_itl) for i, m in enumerate(engine)]
    hung_up = ClientRequest(2, 0.0, 4, 1, 9.0, None, 9.0, None, hung_up=True)
    ours, theirs = summarize(engine), summarize(clients + [hung_up], duration=3.0)
    assert set(ours) == set(theirs)
    assert engine[0].tpot == 1.0 and engine[0].max_itl == 1.5
    for name in ("ttft", "tpot", "max_itl", "e2e"):
        assert ours[name] == theirs[name], name
    assert theirs["queueing"] is None and ours["queueing"]["mean"] == 0.25
    assert (theirs["num_requests"], theirs["num_completed"], theirs["output_tokens"]) == (3, 2, 6)
