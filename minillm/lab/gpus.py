"""The GPU spec table, ``data/gpus.csv`` (chapter 为什么服务大模型难). Pure Python.

A GPU is summed up by three numbers from its datasheet: memory capacity, memory bandwidth and
dense bf16 matrix rate. Their ratio, the ridge point (FLOP per byte), says which work is
bandwidth-bound and which is compute-bound.

Units: memory capacity in GiB (2**30 bytes). Vendors write "24 GB" but DRAM comes in binary sizes: a
"24 GB" card holds 24 GiB, of which the driver keeps a little for itself. Bandwidth in bytes per
second (GB/s = 1e9 bytes/s); matrix rate in FLOP/s (a multiply-add counts 2).
"""
from __future__ import annotations

import csv
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from minillm.engine.units import GiB

GPUS_CSV = Path(__file__).resolve().parents[2] / "data" / "gpus.csv"


@dataclass(frozen=True)
class GPUSpec:
    """One row of ``data/gpus.csv``: a GPU as its vendor's datasheet describes it."""

    name: str
    memory_gib: float  # nominal capacity in GiB
    bandwidth_gb_s: float  # memory bandwidth, 1 GB/s = 1e9 bytes/s
    bf16_dense_tflops: float  # dense (not 2:4 sparse) bf16 tensor-core rate
    source: str  # URL of the datasheet or whitepaper the numbers come from
    aliases: tuple[str, ...] = ()  # other names, e.g. what torch.cuda.get_device_name() reports
    note: str = ""

    @property
    def memory_bytes(self) -> int:
        return round(self.memory_gib * GiB)

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.bandwidth_gb_s * 1e9

    @property
    def bf16_flops(self) -> float:
        """FLOP per second."""
        return self.bf16_dense_tflops * 1e12

    @property
    def ridge_point(self) -> float:
        """FLOP per byte at which the matrix rate and the bandwidth take the same time."""
        return self.bf16_flops / self.bandwidth


@functools.cache
def gpu_specs() -> tuple[GPUSpec, ...]:
    """All rows of ``data/gpus.csv``, in file order."""
    with open(GPUS_CSV, newline="") as f:
        return tuple(
            GPUSpec(
                name=row["name"],
                memory_gib=float(row["memory_gib"]),
                bandwidth_gb_s=float(row["bandwidth_gb_s"]),
                bf16_dense_tflops=float(row["bf16_dense_tflops"]),
                source=row["source"],
                aliases=tuple(a for a in row["aliases"].split(";") if a),
                note=row["note"],
            )
            for row in csv.DictReader(f)
        )


def _name_key(name: str) -> str:
    """'NVIDIA GeForce RTX-4090' -> 'rtx4090': case, spaces, dashes and the brand words ignored."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for brand in ("nvidia", "geforce"):
        key = key.removeprefix(brand)
    return key


def find_gpu(name: str) -> GPUSpec | None:
    """The spec whose name or alias matches ``name`` (see ``lookup_gpu``), else None."""
    key = _name_key(name)
    for spec in gpu_specs():
        if key and key in {_name_key(n) for n in (spec.name, *spec.aliases)}:
            return spec
    return None


def lookup_gpu(name: str) -> GPUSpec:
    """The spec of a GPU by name: case, spaces and dashes don't matter ('h100-sxm', 'H100 SXM')."""
    spec = find_gpu(name)
    if spec is None:
        known = ", ".join(s.name for s in gpu_specs())
        raise ValueError(f"unknown GPU {name!r} (known: {known})")
    return spec
