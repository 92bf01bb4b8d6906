"""The device in use and probes of its two ceilings (all chapters; 为什么服务大模型难).

The spec table (``minillm.lab.gpus``) gives a GPU's datasheet ceilings; the probes measure the same
two ceilings on the device actually in use, a CPU included, so every estimate in the book can be
made for "this machine".

Units:
- bandwidth in bytes per second, GB/s = 1e9 bytes/s. A probe counts the bytes a copy MOVES, read
  plus written: copying N bytes moves 2N. That is the convention to compare with a decode step's
  "bytes read / step time", since both count traffic on the memory bus.
- matrix rate in FLOP/s (a multiply-add counts 2), TFLOP/s = 1e12 FLOP/s.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from minillm.engine.device import resolve_device, synchronize
from minillm.engine.units import GiB, MiB
from minillm.lab.gpus import GPUSpec, find_gpu



@dataclass(frozen=True)
class DeviceInfo:
    """What the device in use is: its name, memory and, for a known GPU, its spec row."""

    type: str  # "cuda" or "cpu"
    name: str  # GPU name, or the CPU model
    memory_bytes: int  # GPU memory, or the machine's RAM for the CPU (0: unknown)
    spec: GPUSpec | None  # the matching row of data/gpus.csv, if any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _ram_bytes() -> int:
    """Physical memory of this machine; 0 where the OS does not say (Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def describe_device(device: torch.device | str | None = None) -> DeviceInfo:
    """Name and memory of ``device`` (default: ``pick_device()``)."""
    device = resolve_device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
        return DeviceInfo("cuda", name, memory, find_gpu(name))
    return DeviceInfo("cpu", _cpu_model(), _ram_bytes(), None)


def measure_seconds(fn: Callable[[], object], device: torch.device | str, repeats: int,
                    warmup: int = 1, inner: int = 1) -> list[float]:
    """Seconds per call of ``fn``: ``repeats`` samples after ``warmup`` calls.

    Each sample runs ``inner`` calls back to back between two synchronizations of the device, so
    short GPU work is timed without the host's launch and sync overhead per call.
    """
    for field, value in (("repeats", repeats), ("inner", inner)):
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / inner)
    return samples


def time_once(fn: Callable[[], object], device: torch.device | str) -> float:
    """Seconds of one call of ``fn``, the device synchronized before and after (no warm-up: for
    runs that take turns, each already warm)."""
    return measure_seconds(fn, device, repeats=1, warmup=0)[0]


def probe_copy_bandwidth(device: torch.device | str | None = None, nbytes: int | None = None,
                         repeats: int | None = None) -> float:
    """Measured memory bandwidth in bytes/s: bytes moved (read + written) by a large tensor copy.

    Copying ``nbytes`` reads ``nbytes`` and writes ``nbytes``, so this returns
    ``2 * nbytes / median(seconds)``. Defaults: 256 MiB, 5 repeats on the CPU (well beyond its
    caches, under a second or two); 1 GiB, 10 repeats of 10 copies each on CUDA.
    """
    device = resolve_device(device)
    on_gpu = device.type == "cuda"
    nbytes = nbytes if nbytes is not None else (GiB if on_gpu else 256 * MiB)
    repeats = repeats if repeats is not None else (10 if on_gpu else 5)
    if nbytes < 4:
        raise ValueError(f"nbytes must be >= 4, got {nbytes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    # Filled, not zeros: untouched zero pages would let the CPU read from one cached page.
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    seconds = measure_seconds(lambda: target.copy_(source), device, repeats,
                              inner=10 if on_gpu else 1)
    return 2 * source.numel() * 4 / statistics.median(seconds)


def probe_matmul_flops(device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                       n: int | None = None, repeats: int | None = None) -> float:
    """Measured matrix-multiply rate in FLOP/s of an ``n x n @ n x n`` product (2 n^3 FLOP).

    Defaults: float32 with n = 1024 and 10 repeats on the CPU (about a second); bfloat16 with
    n = 8192 and 10 repeats of 5 products on CUDA. Random operands: zeros run faster on some GPUs.
    """
    device = resolve_device(device)
    on_gpu = device.type == "cuda"
    dtype = dtype if dtype is not None else (torch.bfloat16 if on_gpu else torch.float32)
    n = n if n is not None else (8192 if on_gpu else 1024)
    repeats = repeats if repeats is not None else 10
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    seconds = measure_seconds(lambda: torch.mm(a, b), device, repeats, inner=5 if on_gpu else 1)
    return 2 * n**3 / statistics.median(seconds)


@dataclass(frozen=True)
class DeviceProbe:
    """The two measured ceilings of a device and their ratio, the ridge point."""

    device: str
    copy_bandwidth: float  # bytes moved (read + written) per second
    matmul_flops: float  # FLOP per second
    matmul_dtype: str  # e.g. "torch.bfloat16"

    @property
    def ridge_point(self) -> float:
        """FLOP per byte moved above which work is compute-bound on this device."""
        return self.matmul_flops / self.copy_bandwidth

    def as_dict(self) -> dict:
        return {"device": self.device, "copy_bandwidth": self.copy_bandwidth,
                "matmul_flops": self.matmul_flops, "matmul_dtype": self.matmul_dtype,
                "ridge_point": self.ridge_point}


def probe_device(device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> DeviceProbe:
    """Both probes with their defaults (``dtype`` for the matrix product)."""
    device = resolve_device(device)
    dtype = dtype if dtype is not None else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return DeviceProbe(device=str(device), copy_bandwidth=probe_copy_bandwidth(device),
                       matmul_flops=probe_matmul_flops(device, dtype), matmul_dtype=str(dtype))
