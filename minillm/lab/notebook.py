"""The one setup every lab starts with, and the helpers labs share (all labs).

``lab = setup()`` applies the book's policy and returns what a lab needs:

* **device**: ``$MINILLM_DEVICE`` if set, else CUDA when present, else the CPU;
* **model**: ``$MINILLM_MODEL`` (a preset, a ``.gguf`` file, a folder with ``config.json``, or a hub
  id) if set. Else, on a GPU, the Llama-3.1-8B shape with random weights: timing and memory do not
  depend on the values. On the CPU, the lab's own default: the real SmolLM2-135M-Instruct
  (``smollm2-135m``) in the labs whose point is what a request says and when it ends (its answers
  end on the model's own end-of-sequence token), a preset at a shape otherwise (``tiny``; ``small``
  where the prefill and decode labs need compute and bandwidth effects to show);
* **weights**: a checkpoint's own when it has them (a GGUF, a folder with safetensors), random ones
  at the preset's shape otherwise;
* **answers**: ``lab.chat(...)`` always asks the real SmolLM2 (on a GPU beside the 8B-shaped timing
  model). It is English-only: the labs ask it in English;
* **dtype**: bf16 on CUDA, fp32 on the CPU;
* **threads**: one torch thread on the CPU. The labs time small operations on shared 2-core
  machines, where a second thread costs more in hand-offs than it saves, and makes timings jump.

Labs read no environment variable themselves; the README states the same defaults.
"""
from __future__ import annotations

import gc
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch

from minillm.engine.config import ModelConfig, load_config
from minillm.engine.device import pick_device
from minillm.engine.loader import checkpoint_weights, load_model
from minillm.engine.model import Transformer
from minillm.lab.hardware import describe_device, measure_seconds
from minillm.lab.machine_profile import CPU_THREADS, MachineProfile, machine_profile
from minillm.lab.records import BenchRecord
from minillm.lab.report import NOT_RECORDED
from minillm.lab.results import Results

GPU_MODEL = "llama-3.1-8b"
CPU_MODEL = "tiny"
TEXT_MODEL = "smollm2-135m"  # the real model that answers (English only)


@dataclass
class Lab:
    """What a lab runs on: the device, the model (real or random weights) and its config."""

    device: torch.device
    model_name: str
    dtype: torch.dtype
    device_name: str
    config: ModelConfig
    model: Transformer | None  # None when setup(load=False)
    weights: str = "random"  # "auto" (the checkpoint's) or "random"
    results: Results | None = field(default=None, repr=False)  # what the page quotes (setup(name))
    _text_model: Transformer | None = field(default=None, repr=False)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def real_weights(self) -> bool:
        return self.weights == "auto"

    @property
    def profile(self) -> MachineProfile:
        """This build's one profile of the device: every "本机" ceiling comes from it."""
        return machine_profile(self.device)

    @property
    def text_model(self) -> Transformer:
        """The real SmolLM2-135M-Instruct on this lab's device (the lab's own model when it is
        that one), loaded on first use."""
        if self.model is not None and self.model_name == TEXT_MODEL:
            return self.model
        if self._text_model is None:
            self._text_model = load_model(TEXT_MODEL, device=self.device, dtype=self.dtype)
        return self._text_model

    def chat(self, question: str, max_tokens: int = 256, **engine_args):
        """Ask the real model one question (in English) through its chat template, greedy; the
        ``RequestOutput``, its text and timings included."""
        from minillm.engine.llm import LLM
        from minillm.engine.sampling import SamplingParams

        llm = LLM(self.text_model, **{"num_kv_blocks": 256, **engine_args})
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return llm.chat([{"role": "user", "content": question}], params, use_tqdm=False)[0]

    def serve(self, text: bool = False, **options):
        """``with lab.serve(...) as server``: ``python -m minillm serve`` of this lab's model (or,
        ``text=True``, of the real SmolLM2) in the background, as the lab runs it (its weights,
        device, dtype and CPU threads); ``options`` are ``serve_in_background``'s
        (``num_kv_blocks=512``...)."""
        from minillm.server.launcher import serve_in_background

        model, weights = (TEXT_MODEL, "auto") if text else (self.model_name, self.weights)
        return serve_in_background(model, weights=weights, device=str(self.device),
                                   dtype=self.dtype_name,
                                   env={"OMP_NUM_THREADS": str(torch.get_num_threads())}, **options)

    @property
    def threads(self) -> str:
        """The thread policy in words, for the lab's header and the book's text."""
        return "GPU" if self.on_gpu else f"{torch.get_num_threads()} 个 CPU 线程"

    def pick(self, cpu, gpu):
        """The lab's size of an experiment: ``gpu`` on a GPU, ``cpu`` on the CPU."""
        return gpu if self.on_gpu else cpu

    def fits(self, nbytes: float) -> bool:
        """Whether the device has ``nbytes`` free for an experiment (always True on the CPU)."""
        return enough_gpu_memory(self.device, nbytes)

    # The results the chapter page quotes (minillm.lab.results) and the claims on them.
    def table(self, name: str, header: list[str], rows: list[list]) -> None:
        """Show a table and keep it for the page."""
        self.results.add_table(name, header, rows)

    def figure(self, name: str, fig) -> None:
        """Keep the figure for the page (call before ``plt.show()``)."""
        self.results.add_figure(name, fig)

    def record(self, **values) -> None:
        """Keep raw values for the claims of ``book/claims.yml``."""
        self.results.record(**values)

    def finish(self) -> None:
        """Save the results for the page and check the book's claims on them: a table of each
        sentence the book writes about this lab, and whether this machine bears it out."""
        from minillm.lab.claims import check
        from minillm.lab.report import show_table

        path = self.results.save(device=self.device_name, threads=self.threads, model=self.config.name,
                                 dtype=self.dtype_name, weights=self.weights)
        verdicts = check(self.results.lab, self.results.values)
        show_table(["书里的说法", "本机是否成立"], [[c.sentence, "成立" if ok else "不成立"] for c, ok in verdicts])
        print(f"结果已存入 {path}，本章正文引用它。")

    def __str__(self) -> str:
        weights = "真实权重" if self.real_weights else "随机权重"
        return (f"设备：{self.device_name}（{self.device.type}，{self.threads}）；模型："
                f"{self.config.name}（{self.dtype_name}，{weights}）")


def setup(name: str | None = None, cpu_model: str = CPU_MODEL, load: bool = True) -> Lab:
    """Apply the policy above; load the model unless ``load=False``. ``name``: the lab's file name
    (``"ch04-decode"``), under which its results are kept for the page; ``cpu_model``: the lab's
    model on the CPU (``TEXT_MODEL`` where what the model says matters)."""
    from minillm.lab.plotting import use_book_style

    use_book_style()
    device = pick_device()
    on_gpu = device.type == "cuda"
    if not on_gpu:
        torch.set_num_threads(CPU_THREADS)
    model_name = os.environ.get("MINILLM_MODEL", "").strip() or (GPU_MODEL if on_gpu else cpu_model)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    weights = checkpoint_weights(model_name)
    model = load_model(model_name, device=device, dtype=dtype, weights=weights) if load else None
    config = model.config if model is not None else load_config(model_name)
    return Lab(device, model_name, dtype, describe_device(device).name, config, model, weights,
               Results(name) if name else None)


# --- Shared helpers ------------------------------------------------------------------------------

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


def enough_gpu_memory(device: torch.device, nbytes: int) -> bool:
    """Whether ``device`` has ``nbytes`` free for an experiment (always True on the CPU); when it
    has not, says so in Chinese, so the lab can shrink the experiment instead of running out."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    if free < nbytes:
        print(f"这张卡现在只剩 {free / 2**30:.1f} GiB 空闲，下一个实验要约 {nbytes / 2**30:.1f} GiB：改用较小的规模。")
    return free >= nbytes


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


def last_level_cache_bytes(device: torch.device) -> int | None:
    """The largest cache ``device`` reports (the GPU's L2, the CPU's highest level); None if unknown."""
    from pathlib import Path

    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = (index / "size").read_text().strip()  # e.g. "2048K"
        sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]])
    return max(sizes, default=None)
