"""One machine profile per build (all chapters): what "本机" means in every chapter.

The probes of ``minillm.lab.hardware`` measure the device's two ceilings, copy bandwidth and matrix
rate. A build runs them once, under one thread policy (the labs', ``notebook.CPU_THREADS`` on the
CPU), keeps the best of a few tries (a busy machine can only slow a probe down) and caches the
result in ``_build/machine_profile-<device>.json``; every page and lab of the build reads that
file, so two chapters never quote two different "本机" bandwidths. Deleting ``_build`` (the test
command does) starts a new profile with the next build.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from minillm.engine.device import resolve_device
from minillm.lab.hardware import describe_device, probe_device

PROFILE_DIR = Path(__file__).resolve().parents[2] / "_build"
CPU_THREADS = 1  # the labs' thread policy on the CPU (minillm.lab.notebook applies the same)
TRIES = 3


@dataclass(frozen=True)
class MachineProfile:
    """The device a build runs on and its two probed ceilings."""

    device_type: str  # "cpu" or "cuda"
    device_name: str
    threads: int  # torch threads the probes (and the labs) use on the CPU
    copy_bandwidth: float  # bytes moved (read + written) per second
    matmul_flops: float  # FLOP per second
    matmul_dtype: str
    load_average: float | None  # the 1-minute load when the probes ran (None: unknown)
    date: str

    @property
    def ridge_point(self) -> float:
        """FLOP per byte moved above which work is compute-bound here."""
        return self.matmul_flops / self.copy_bandwidth


def machine_profile(device=None, directory: Path = PROFILE_DIR) -> MachineProfile:
    """This build's profile of ``device``: read from the cache, or probed now and cached."""
    device = resolve_device(device)
    path = Path(directory) / f"machine_profile-{device.type}.json"
    if path.is_file():
        return MachineProfile(**json.loads(path.read_text()))
    profile = _probe(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(profile), indent=1))
    return profile


def _probe(device: torch.device) -> MachineProfile:
    """The best of ``TRIES`` probes of each ceiling, under the labs' thread policy."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(CPU_THREADS)
    try:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        probes = [probe_device(device, dtype) for _ in range(TRIES)]
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    return MachineProfile(
        device_type=device.type, device_name=describe_device(device).name, threads=used_threads,
        copy_bandwidth=max(p.copy_bandwidth for p in probes),
        matmul_flops=max(p.matmul_flops for p in probes),
        matmul_dtype=str(dtype), load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
