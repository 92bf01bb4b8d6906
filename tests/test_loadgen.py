"""The load generator's pieces without a server (chapter: serving over HTTP): its workloads, the
Prometheus text of minillm and vLLM read alike, the client run record written and read back, and
what diagnose says from a client's side (tests/test_server.py runs it against a real server)."""
import copy
import math

import pytest

from minillm.lab import loadgen, records
from minillm.lab.diagnose import diagnose_client
from minillm.lab.loadgen import ClientRequest

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{model_name="m"} 4.0
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 7.0
vllm:request_success_total{finished_reason="abort",model_name="m"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 8.0
vllm:time_to_first_token_seconds_count{model_name="m"} 8.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 2.0
# TYPE python_gc_objects_collected counter
python_gc_objects_collected_total{generation="0"} 12.0
"""


def test_the_workloads_of_the_book():
    colleagues = loadgen.serving_workload("twenty-colleagues", 1000)
    assert colleagues.name == "twenty-colleagues" and len(colleagues) == 20
    assert max(colleagues.input_lens) == 8192 and sorted(colleagues.input_lens)[-2] <= 128
    assert colleagues.arrival_times == [0.0] * 20
    poisson = loadgen.serving_workload("poisson", 1000, num_requests=50, rate=5.0)
    assert len(poisson) == 50 and poisson.arrival_times == sorted(poisson.arrival_times)
    assert 2 < poisson.arrival_times[-1] < 30  # about 10 s at 5 per second
    burst = loadgen.serving_workload("burst", 1000, num_requests=8, input_len=32, output_len=4)
    assert burst.input_lens == [32] * 8 and burst.output_lens == [4] * 8
    with pytest.raises(ValueError, match="workload must be one of"):
        loadgen.serving_workload("flood")


def test_vllm_metrics_read_like_minillm_ones():
    backend, values = loadgen.parse_metrics(VLLM_METRICS)
    assert backend == "vllm"
    assert values == {"num_requests_running": 3.0, "kv_cache_usage_perc": 0.5,
                      "num_preemptions_total": 4.0, "request_success_total.stop": 7.0,
                      "request_success_total.abort": 1.0, "time_to_first_token_seconds_count": 8.0,
                      "time_to_first_token_seconds_sum": 2.0}
    rejected = ('# TYPE minillm:request_rejected counter\n'
                'minillm:request_rejected_total{model_name="m",reason="queue_full"} 3.0\n')
    assert loadgen.parse_metrics(rejected) == ("minillm", {"request_rejected_total.queue_full": 3.0})
    assert loadgen.parse_metrics("# nothing here\n") == (None, {})


def client_record(ttft: float, e2e: float, errors: int = 0, preemptions: int = 0,
                  peak_kv: float = 0.3, metrics: bool = True) -> dict:
    requests = [ClientRequest(i, 0.01 * i, 100, 32, ttft, (e2e - ttft) / 31, e2e, "length")
                for i in range(10)]
    for request in requests[:errors]:
        request.error, request.finish_reason, request.num_output_tokens = \
            {"status": 503, "message": "busy"}, None, 0
    duration = max(r.start + r.e2e for r in requests)
    server_metrics = {
        "before": {}, "after": {},
        "delta": {"num_preemptions_total": preemptions, "time_to_first_token_seconds_sum": 9 * ttft,
                  "time_to_first_token_seconds_count": 10, "request_queue_time_seconds_sum": 2 * ttft,
                  "request_queue_time_seconds_count": 10, "prefix_cache_queries_total": 1000,
                  "prefix_cache_hits_total": 0},
        "samples": [{"t": 0.5, "num_requests_running": 4, "num_requests_waiting": 6,
                     "kv_cache_usage_perc": peak_kv}]}
    return {"format": records.CLIENT_RUN_FORMAT, "version": 1,
            "server": {"url": "http://x", "model": "m", "backend": "minillm" if metrics else None,
                       "max_model_len": 4096},
            "workload": {"name": "burst"}, "duration_s": duration,
            "requests": [vars(r) for r in requests],
            "server_metrics": server_metrics if metrics else None,
            "summary": loadgen.summarize_clients(requests, duration)}


def test_the_client_record_round_trips_and_bad_ones_are_named(tmp_path):
    record = client_record(0.2, 1.0)
    assert record["summary"]["num_completed"] == 10 and record["summary"]["output_tokens"] == 320
    path = records.save_client_run(record, tmp_path / "run.json")
    assert records.load_record(path) == record
    broken = copy.deepcopy(record)
    del broken["requests"][3]["ttft"]
    with pytest.raises(ValueError, match=r"missing requests\[3\].ttft"):
        records.load_client_run(broken)
    with pytest.raises(ValueError, match="not a minillm client run record"):
        records.load_client_run({"format": records.RUN_FORMAT})


@pytest.mark.parametrize("ttft, e2e, symptom", [(0.8, 1.0, "first_token"), (0.1, 2.0, "tokens")])
def test_client_diagnosis_names_the_symptom_and_cannot_name_a_wall_without_evidence(ttft, e2e, symptom):
    diagnosis = diagnose_client(client_record(ttft, e2e))
    assert (diagnosis.symptom, diagnosis.wall) == (symptom, None)
    assert math.isclose(diagnosis.latency.first_token_share, ttft / e2e)
    assert math.isclose(diagnosis.extra_ttft, ttft - 0.9 * ttft)
    report = diagnosis.report()
    assert "not decidable from the client side" in report and "step log" in report


def test_client_diagnosis_sees_capacity_and_failures_in_the_metrics():
    diagnosis = diagnose_client(client_record(0.5, 1.0, errors=2, preemptions=3))
    assert (diagnosis.symptom, diagnosis.wall) == ("failure", "capacity")
    assert diagnosis.num_errors == 2 and diagnosis.errors_by_status == {"503": 2}
    assert diagnosis.latency.num_requests == 10 and diagnosis.latency.ttft is not None
    full = diagnose_client(client_record(0.5, 1.0, peak_kv=0.95))
    assert full.wall == "capacity" and "KV use peaked at 95%" in full.report()


def test_without_server_metrics_the_report_says_what_is_unknown():
    diagnosis = diagnose_client(client_record(0.5, 1.0, metrics=False))
    assert diagnosis.server_view is None and diagnosis.wall is None
    assert "exported no Prometheus metrics" in diagnosis.report()
