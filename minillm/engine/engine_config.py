"""The engine's settings, validated once (chapters 一张 24 GiB 的卡放 8B 模型, 分页的 KV cache, 调度).

``LLM(...)`` and ``LLMEngine(...)`` take these as keyword arguments and build one ``EngineConfig``;
once the model is loaded (and the planner has sized the pool), :meth:`EngineConfig.resolved`
decides every default left in one copy, which the scheduler and the model runner read and check
nothing again. Pure Python, so a bad setting is refused before torch allocates anything.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass

from minillm.engine.units import GiB, ceil_div, parse_size

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULINGS = ("continuous", "static")
PREFIX_INDEXES = ("hash", "radix")
QUANTIZATIONS = (None, "int8", "int4")  # weight-only (minillm.engine.quantization)
GROUP_SIZES = (32, 128)  # int4's groups along the input dimension
KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": the model's dtype; "fp8": e4m3, one byte per element
SWAP_SPACE_BYTES = 4 * GiB  # default CPU pool for swap preemption (vLLM's swap_space default)
SPECULATIVE_METHODS = ("ngram", "draft_layers")  # prompt lookup; the target's own first layers as the draft
CPU_KVCACHE_SPACE_GIB = 4  # the CPU's KV pool when nothing sizes it (vLLM's VLLM_CPU_KVCACHE_SPACE default)


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_max_model_len(max_model_len: int | None, max_position_embeddings: int) -> None:
    if max_model_len is not None and max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len:,} exceeds the model's "
                         f"max_position_embeddings={max_position_embeddings:,}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def cpu_kvcache_bytes() -> int:
    """Bytes of the KV pool on the CPU when no setting sizes it: ``$MINILLM_CPU_KVCACHE_SPACE``
    GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``), default ``CPU_KVCACHE_SPACE_GIB``."""
    text = os.environ.get("MINILLM_CPU_KVCACHE_SPACE", "").strip()
    if not text:
        return CPU_KVCACHE_SPACE_GIB * GiB
    try:
        space = float(text)
    except ValueError:
        space = math.nan
    if not math.isfinite(space) or space <= 0:
        raise ValueError(f"MINILLM_CPU_KVCACHE_SPACE must be a positive number of GiB (the CPU's KV "
                         f"pool), got {text!r}")
    return round(space * GiB)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys): up to ``num_speculative_tokens``
    tokens proposed per request and step, by one of two methods.

    ``"ngram"``, prompt lookup: the last n tokens of a request, n from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``, are matched against its earlier tokens. A missing lookup size takes the
    other's value; both missing: 5 and 5 (vLLM's defaults).
    ``"draft_layers"``, self-speculation: the target's first ``num_draft_layers`` layers, its final
    norm and its output layer are the draft (checked against the model when it is loaded).
    A separate draft model (vLLM's ``"model"`` key) is refused: it would need a KV cache of its own."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_draft_layers: int | None = None

    @classmethod
    def from_dict(cls, settings) -> "SpeculativeConfig":
        """``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
        "prompt_lookup_min": m}`` or ``{"method": "draft_layers", "num_speculative_tokens": k,
        "num_draft_layers": L}`` (a ``SpeculativeConfig`` passes as it is); ``ValueError`` else."""
        if isinstance(settings, cls):
            return settings
        if not isinstance(settings, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                             f"'num_speculative_tokens': 3}}, got {settings!r}")
        if "model" in settings or settings.get("method") == "draft_model":
            raise ValueError("speculative_config: a separate draft model ('model') is not supported "
                             "(it would need a KV cache of its own); the draft can be the target's "
                             "own first layers: {'method': 'draft_layers', 'num_draft_layers': L, "
                             "'num_speculative_tokens': k}, or prompt lookup: {'method': 'ngram', ...}")
        check_choice("speculative_config['method']", settings.get("method"), SPECULATIVE_METHODS)
        method = settings["method"]
        keys = ({"prompt_lookup_max", "prompt_lookup_min"} if method == "ngram" else {"num_draft_layers"})
        unknown = set(settings) - {"method", "num_speculative_tokens"} - keys
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} for method {method!r}")
        check_positive_int("speculative_config['num_speculative_tokens']",
                           settings.get("num_speculative_tokens"))
        if method == "draft_layers":
            check_positive_int("speculative_config['num_draft_layers']", settings.get("num_draft_layers"))
            return cls(method, settings["num_speculative_tokens"], num_draft_layers=settings["num_draft_layers"])
        high, low = settings.get("prompt_lookup_max"), settings.get("prompt_lookup_min")
        if high is None and low is None:
            high = low = 5
        high, low = (low if high is None else high), (high if low is None else low)
        check_positive_int("speculative_config['prompt_lookup_max']", high)
        check_positive_int("speculative_config['prompt_lookup_min']", low)
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
        return cls(method, settings["num_speculative_tokens"], high, low)

    def check_model(self, num_layers: int) -> None:
        """A draft of the target's first layers must leave at least one layer out."""
        if self.method == "draft_layers" and not 1 <= self.num_draft_layers <= num_layers - 1:
            raise ValueError(f"speculative_config: num_draft_layers must be in [1, {num_layers - 1}] "
                             f"(the model has {num_layers} layers), got {self.num_draft_layers}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine uses the card and schedules requests (vLLM's names and defaults)."""

    block_size: int = 16  # token slots per KV block
    num_kv_blocks: int | None = None  # None: the planner sizes the pool from the card's memory (CPU: cpu_kvcache_bytes)
    max_model_len: int | None = None  # longest request; None: what the plan or model allows; -1: longest that fits
    max_num_seqs: int = 256  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens one step may compute (the token budget)
    gpu_memory_utilization: float = 0.92  # share of the card the engine may use
    memory_limit: int | None = None  # plan as if the card had this many bytes (text like "24GiB" accepted)
    enable_prefix_caching: bool = True
    prefix_index: str = "hash"  # "hash" (vLLM's block-hash chain) or "radix" (SGLang's radix tree)
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    num_cpu_blocks: int | None = None  # swap pool; None: as large as the GPU pool, at most 4 GiB
    scheduling: str = "continuous"  # or "static", the baseline of chapter 调度
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batches to capture; None: 1, 2, 4, 8, 16... on CUDA
    compile_decode: bool = False  # CPU: one sequence's decode steps through torch.compile (the first compiles)
    quantization: str | None = None  # "int8" or "int4": weight-only, applied when the model is loaded
    group_size: int = 32  # int4's group along the input dimension (32 or 128)
    kv_cache_dtype: str = "auto"  # "fp8": the paged cache holds e4m3 keys and values (vLLM's name)
    speculative_config: SpeculativeConfig | None = None  # a dict of vLLM's keys turns speculation on
    tensor_parallel_size: int = 1  # ranks (processes, one device each) that split every layer

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            check_positive_int(name, getattr(self, name))
        if self.num_kv_blocks is not None:
            check_positive_int("num_kv_blocks (or None for the planner)", self.num_kv_blocks)
        if self.max_model_len is not None and self.max_model_len != -1:
            check_positive_int("max_model_len (or -1 for the longest that fits, or None)",
                               self.max_model_len)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(
                self.gpu_memory_utilization, numbers.Real) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.memory_limit is not None:
            try:
                object.__setattr__(self, "memory_limit", parse_size(self.memory_limit))
            except ValueError as err:
                raise ValueError(f"memory_limit: {err}") from None
        if self.num_cpu_blocks is not None and (not isinstance(self.num_cpu_blocks, int)
                                                or self.num_cpu_blocks < 0):
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {self.num_cpu_blocks!r}")
        if self.cuda_graph_sizes is not None:
            object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))
            for size in self.cuda_graph_sizes:
                check_positive_int("cuda_graph_sizes (each)", size)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "compile_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_choice("prefix_index", self.prefix_index, PREFIX_INDEXES)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_choice("scheduling", self.scheduling, SCHEDULINGS)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("group_size", self.group_size, GROUP_SIZES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.compile_decode and self.kv_cache_dtype == "fp8":
            raise ValueError("compile_decode does not combine with an fp8 KV cache: use kv_cache_dtype='auto'")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if self.tensor_parallel_size > 1:
            unsupported = [name for name, on in (("quantization", self.quantization is not None),
                                                 ("speculative_config", self.speculative_config is not None),
                                                 ("cuda_graph_sizes", bool(self.cuda_graph_sizes)),
                                                 ("compile_decode", self.compile_decode)) if on]
            if unsupported:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} does not combine with "
                                 f"{', '.join(unsupported)} in minillm: use tensor_parallel_size=1 for them")

    @property
    def max_sampled_rows(self) -> int:
        """The most logit rows one step samples: one per running request, or k + 1 for one that
        verifies k proposals, within the token budget (the rows the planner sizes the sampler for)."""
        spec = self.speculative_config
        rows_per_seq = 1 if spec is None else spec.num_speculative_tokens + 1
        return min(self.max_num_seqs * rows_per_seq, self.max_num_batched_tokens)

    def replace(self, **changes) -> "EngineConfig":
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def resolved(self, max_position_embeddings: int, kv_bytes_per_block: int, memory_plan=None,
                 cpu_kv_bytes: int | None = None) -> "EngineConfig":
        """The copy with every default decided and checked against the model and the pool: the pool
        and ``max_model_len`` from ``memory_plan`` when the planner sized it; on the CPU with no size
        given (``cpu_kv_bytes``, vLLM's CPU backend), as many blocks as fit in ``cpu_kv_bytes``, at
        most ``max_num_seqs`` requests of ``max_model_len``; ``max_model_len`` None or -1: as long
        as the positions and the pool allow. ``num_cpu_blocks`` None: a swap pool as large as the
        KV pool, at most ``SWAP_SPACE_BYTES``; 0 without swap preemption."""
        num_kv_blocks, max_model_len = ((memory_plan.num_blocks, memory_plan.max_model_len) if memory_plan
                                        else (self.num_kv_blocks, self.max_model_len))
        if num_kv_blocks is None:
            if cpu_kv_bytes is None:
                raise ValueError("num_kv_blocks is None: the planner's memory_plan or cpu_kv_bytes sizes the pool")
            longest = max_position_embeddings if max_model_len in (None, -1) else max_model_len
            num_kv_blocks = min(cpu_kv_bytes // kv_bytes_per_block,
                                self.max_num_seqs * ceil_div(longest, self.block_size))
            if num_kv_blocks < 1:
                raise ValueError(f"the CPU's KV pool of {cpu_kv_bytes:,} bytes ($MINILLM_CPU_KVCACHE_SPACE) "
                                 f"holds no block of {kv_bytes_per_block:,} bytes")
        pool_tokens = num_kv_blocks * self.block_size
        if max_model_len is None or max_model_len == -1:
            max_model_len = min(max_position_embeddings, pool_tokens)
        check_max_model_len(max_model_len, max_position_embeddings)
        if not 2 <= max_model_len <= pool_tokens:
            raise ValueError(f"max_model_len must be in [2, {pool_tokens}] (the KV pool holds "
                             f"{num_kv_blocks} blocks x {self.block_size} tokens), got {max_model_len}")
        num_cpu_blocks = 0 if self.preemption_mode != "swap" else (
            min(num_kv_blocks, SWAP_SPACE_BYTES // kv_bytes_per_block) if self.num_cpu_blocks is None
            else self.num_cpu_blocks)
        return self.replace(num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, num_cpu_blocks=num_cpu_blocks)

    @property
    def pool_tokens(self) -> int:
        """Token slots in the KV pool (once ``num_kv_blocks`` is known)."""
        if self.num_kv_blocks is None:
            raise ValueError("num_kv_blocks is not set yet: the planner decides it")
        return self.num_kv_blocks * self.block_size


def add_quantization_options(command) -> None:
    """``--quantization``, ``--group-size`` and ``--kv-cache-dtype`` (vLLM's names) on an argparse
    command: every command that loads a model takes them."""
    command.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q],
                         help="weight-only quantization of the linears (default: none)")
    command.add_argument("--group-size", type=int, default=32, choices=GROUP_SIZES,
                         help="int4 groups along the input dimension (default 32)")
    command.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                         help="fp8: keys and values in e4m3, one byte each (default: the model's dtype)")


def add_compile_option(command) -> None:
    """``--compile-decode`` on an argparse command that runs the engine."""
    command.add_argument("--compile-decode", action="store_true", default=None,
                         help="CPU: compile one sequence's decode step with torch.compile (the first run "
                              "compiles for about a minute; later runs read Inductor's cache)")
