"""The one setup every lab starts with, and the helpers labs share (all labs).

``lab = setup()`` applies the book's policy and returns what a lab needs:

* **device**: ``$MINILLM_DEVICE`` if set, else CUDA when present, else the CPU;
* **model**: ``$MINILLM_MODEL`` (a preset, a folder with ``config.json``, or a hub id) if set; else
  the Llama-3.1-8B shape with random weights on a GPU, and on the CPU the lab's small preset
  (``tiny`` unless the lab asks for another: the prefill and decode labs need ``small`` to show
  bandwidth and compute effects);
* **dtype**: bf16 on CUDA, fp32 on the CPU;
* **threads**: one torch thread on the CPU. The labs time small operations on shared 2-core
  machines, where a second thread costs more in hand-offs than it saves, and makes timings jump.

Labs read no environment variable themselves; the README states the same defaults.
"""
from __future__ import annotations

import gc
import os
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from minillm.engine.config import ModelConfig, load_config
from minillm.engine.device import pick_device
from minillm.engine.loader import load_model
from minillm.engine.model import Transformer
from minillm.lab.hardware import describe_device, measure_seconds
from minillm.lab.machine_profile import CPU_THREADS, MachineProfile, machine_profile
from minillm.lab.records import BenchRecord
from minillm.lab.report import NOT_RECORDED

GPU_MODEL = "llama-3.1-8b"
CPU_MODEL = "tiny"


@dataclass
class Lab:
    """What a lab runs on: the device, the model (loaded with random weights) and its config."""

    device: torch.device
    model_name: str
    dtype: torch.dtype
    device_name: str
    config: ModelConfig
    model: Transformer | None  # None when setup(load=False)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def profile(self) -> MachineProfile:
        """This build's one profile of the device: every "本机" ceiling comes from it."""
        return machine_profile(self.device)

    @property
    def threads(self) -> str:
        """The thread policy in words, for the lab's header and the book's text."""
        return "GPU" if self.on_gpu else f"{torch.get_num_threads()} 个 CPU 线程"

    def __str__(self) -> str:
        return (f"device: {self.device_name} ({self.device.type}, {self.threads}), model: "
                f"{self.config.name} ({self.dtype_name})")


def setup(cpu_model: str = CPU_MODEL, load: bool = True) -> Lab:
    """Apply the policy above; load the model with random weights unless ``load=False``."""
    from minillm.lab.plotting import use_book_style

    use_book_style()
    device = pick_device()
    on_gpu = device.type == "cuda"
    if not on_gpu:
        torch.set_num_threads(CPU_THREADS)
    model_name = os.environ.get("MINILLM_MODEL", "").strip() or (GPU_MODEL if on_gpu else cpu_model)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = load_model(model_name, device=device, dtype=dtype, weights="random") if load else None
    config = model.config if model is not None else load_config(model_name)
    return Lab(device, model_name, dtype, describe_device(device).name, config, model)


# --- Shared helpers ------------------------------------------------------------------------------

def g(key: str, value) -> None:
    """Glue ``value`` (text) under ``key`` for the chapter's prose, without showing it here."""
    from myst_nb import glue

    glue(key, value, display=False)


def ms(seconds: float) -> str:
    """``12.3 ms``."""
    return f"{seconds * 1e3:,.1f} ms"


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5,
                   warmup: int = 1, inner: int = 1) -> float:
    """The median of ``repeats`` timed samples of ``fn`` (``inner`` calls each) after ``warmup``
    untimed calls."""
    return statistics.median(measure_seconds(fn, device, repeats, warmup=warmup, inner=inner))


def free_memory(device: torch.device) -> None:
    """Give the memory of dropped models, engines and caches back before the next allocation."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def recorded(record: BenchRecord | None, text: Callable[[BenchRecord], str | None]) -> str:
    """A GPU column cell: ``text(record)`` followed by the GPU and model it was measured on, or the
    plain "not recorded yet" when there is no record (or ``text`` finds nothing in it)."""
    value = text(record) if record is not None else None
    if value is None:
        return NOT_RECORDED
    return f"{value}（{record.device}，{record.model}）"


def room(lengths, max_tokens: int, block_size: int) -> int:
    """KV pool tokens that hold every request at once: each prompt of ``lengths`` plus
    ``max_tokens`` new tokens, in whole blocks of ``block_size``."""
    from minillm.engine.units import ceil_div

    return sum(ceil_div(n + max_tokens, block_size) * block_size for n in lengths)


def greedy(max_tokens: int):
    """``SamplingParams`` for exactly ``max_tokens`` greedy tokens (EOS ignored): runs whose
    length does not depend on the random weights."""
    from minillm.engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
