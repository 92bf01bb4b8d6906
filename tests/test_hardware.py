"""The GPU spec table, device detection and the probes of this device's ceilings."""
import pytest
import torch

from minillm.engine.device import pick_device
from minillm.engine.units import GiB
from minillm.lab import hardware
from minillm.lab.gpus import gpu_specs, lookup_gpu
from minillm.lab.hardware import (describe_device, measure_seconds, probe_copy_bandwidth, probe_device,
                                  probe_matmul_flops)

EXPECTED_GPUS = ["RTX 4090", "RTX 3090", "A10", "L4", "L40S", "A100 40GB SXM", "A100 80GB SXM",
                 "H100 SXM", "H100 PCIe", "H200"]


def test_table_has_every_gpu_with_positive_numbers_and_a_source():
    specs = gpu_specs()
    assert [s.name for s in specs] == EXPECTED_GPUS
    for spec in specs:
        assert spec.memory_gib > 0 and spec.bandwidth_gb_s > 0 and spec.bf16_dense_tflops > 0
        assert spec.source.startswith("https://"), spec.name


def test_datasheet_numbers_the_book_quotes():
    # The seeds' decode floors use these bandwidths; DESIGN.md's 24 GiB card is the RTX 4090 class.
    assert lookup_gpu("A100 80GB SXM").bandwidth == 2039e9
    assert lookup_gpu("H100 SXM").bandwidth == 3350e9
    h200 = lookup_gpu("H200")
    assert (h200.memory_gib, h200.bandwidth_gb_s) == (141, 4800)
    assert lookup_gpu("RTX 4090").memory_bytes == 24 * GiB


def test_units_and_ridge_point():
    spec = lookup_gpu("H100 SXM")
    assert spec.bf16_flops == spec.bf16_dense_tflops * 1e12
    assert spec.ridge_point == pytest.approx(989.5e12 / 3350e9)
    for spec in gpu_specs():
        assert spec.ridge_point == pytest.approx(spec.bf16_flops / spec.bandwidth)


@pytest.mark.parametrize("name, expected", [
    ("h100-sxm", "H100 SXM"), ("H100SXM", "H100 SXM"), ("  h100 sxm ", "H100 SXM"),
    ("a100-80gb-sxm", "A100 80GB SXM"), ("A100 40GB SXM", "A100 40GB SXM"), ("l40s", "L40S"),
    ("rtx_4090", "RTX 4090"),
    # what torch.cuda.get_device_name() reports
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"),
])
def test_lookup_is_tolerant(name, expected):
    assert lookup_gpu(name).name == expected


@pytest.mark.parametrize("name", ["H300", "", "A100"])
def test_unknown_gpu_lists_known_names(name):
    with pytest.raises(ValueError) as err:
        lookup_gpu(name)
    for known in EXPECTED_GPUS:
        assert known in str(err.value)


def test_pick_device(monkeypatch):
    monkeypatch.delenv("MINILLM_DEVICE", raising=False)
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("MINILLM_DEVICE", "cpu")
    assert pick_device() == torch.device("cpu")
    monkeypatch.setenv("MINILLM_DEVICE", "not-a-device")
    with pytest.raises(ValueError, match="MINILLM_DEVICE"):
        pick_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_pick_device_refuses_cuda_without_cuda(monkeypatch):
    monkeypatch.setenv("MINILLM_DEVICE", "cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        pick_device()


def test_describe_cpu():
    info = describe_device("cpu")
    assert info.type == "cpu" and info.name and info.spec is None
    assert info.memory_bytes > 2**28


def test_measure_seconds_counts_calls():
    calls = []
    samples = measure_seconds(lambda: calls.append(1), "cpu", repeats=4, warmup=2, inner=3)
    assert len(samples) == 4 and all(s >= 0 for s in samples)
    assert len(calls) == 2 + 4 * 3
    with pytest.raises(ValueError, match="repeats"):
        measure_seconds(lambda: None, "cpu", repeats=0)


def test_probes_return_positive_rates():
    assert probe_copy_bandwidth("cpu", nbytes=8 * 2**20, repeats=3) > 0
    assert probe_matmul_flops("cpu", torch.float32, n=128, repeats=3) > 0


@pytest.mark.parametrize("call, field", [
    (lambda: probe_copy_bandwidth("cpu", nbytes=0), "nbytes"),
    (lambda: probe_copy_bandwidth("cpu", repeats=0), "repeats"),
    (lambda: probe_matmul_flops("cpu", n=0), "n"),
    (lambda: probe_matmul_flops("cpu", dtype=torch.int32), "dtype"),
    (lambda: probe_copy_bandwidth("meta"), "device"),
])
def test_probes_reject_bad_arguments(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_probe_device_ridge_point(monkeypatch):
    # Fixed probe values make the ratio exact; the real probes are exercised above.
    monkeypatch.setattr(hardware, "probe_copy_bandwidth", lambda device: 20e9)
    monkeypatch.setattr(hardware, "probe_matmul_flops", lambda device, dtype: 500e9)
    probe = probe_device("cpu")
    assert probe.ridge_point == 25.0
    assert probe.as_dict() == {"device": "cpu", "copy_bandwidth": 20e9, "matmul_flops": 500e9,
                               "matmul_dtype": "torch.float32", "ridge_point": 25.0}


def test_probe_device_measures_with_defaults():
    probe = probe_device("cpu")
    assert probe.copy_bandwidth > 0 and probe.matmul_flops > 0
    assert probe.ridge_point == probe.matmul_flops / probe.copy_bandwidth
